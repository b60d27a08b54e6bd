"""The script codegen.emit writes runs under torchrun on 2 CPU ranks and trains like one process."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import LR, MODELS, Case, batches, call_loss, free_port, make_plan  # noqa: E402

import autopar.codegen  # noqa: E402

STEPS = 2


def test_emitted_script_trains_like_one_process(tmp_path):
    case = Case("emit", "gpt2", dict(dp=1, tp=1, pp=2, micro_batch_size=1, zero=0, recompute="none",
                                     schedule="1f1b", virtual_stages=1, sequence_parallel=False), 2)
    plan = make_plan(case)
    script = autopar.codegen.emit(plan, tmp_path, "factories:gpt2_model", batch_factory="factories:gpt2_batch",
                                  lr=LR)
    text = open(script).read()
    assert "CHUNK_LAYERS" in text and "SCHEDULE" in text and "F0.0" in text
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, root]), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    losses = tmp_path / "losses.txt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), script, "--steps", str(STEPS), "--loss-file", str(losses),
                          "--timeout", "120"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = [float(x) for x in losses.read_text().split()]

    model = MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    want = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = call_loss(model, batches("gpt2", step + 1, case.global_batch)[step], None)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert len(got) == STEPS
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-5), (got, want)  # fp32, additions reordered only
