"""examples/quickstart.py runs as the README says, and makes what it says it makes; the laptop-sized
examples/quickstart_cpu.py plans on the meta device from batch-1 inputs, and the script it emits
trains under torchrun on 2 CPU ranks exactly as one process does."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import pytest
import torch

import autopar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--out", str(out)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = autopar.load_plan(out / "plan.json")
    assert plan.model_name == "LlamaForCausalLM" and plan.devices == 32 and plan.fits and plan.optimal
    assert proc.stdout.startswith(plan.summary())
    assert "Runners-up and why each lost:" in proc.stdout and "is faster:" in proc.stdout
    for name in ("timeline", "memory", "partition"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    script = (out / "run" / "train.py").read_text()
    assert "from quickstart import build_model as model_factory" in script


def test_quickstart_cpu_plans_on_meta_and_trains_like_one_process(tmp_path):
    pytest.importorskip("transformers")
    out, losses, steps, lr = tmp_path / "out", tmp_path / "losses.txt", 2, 1e-4   # lr: emit's default
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "examples"), ROOT])}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart_cpu.py"), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = autopar.load_plan(out / "plan.json")
    assert plan.devices == 2 and plan.extra["inputs"]["kwargs"]["input_ids"]["shape"][0] == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), str(out / "run" / "train.py"), "--steps", str(steps), "--loss-file", str(losses)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [float(x) for x in losses.read_text().split()]

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import quickstart_cpu
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)   # train.py's default --seed
    model, _ = quickstart_cpu.build_model("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    want = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(**quickstart_cpu.batch(step, plan.global_batch_size)).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert len(got) == steps
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-5), (got, want)   # fp32; micro-batch means of equal-size batches
