"""``emit(..., standalone=True)`` compiles a plan into a folder that trains with torch alone: run under
torchrun on 2 gloo ranks with an import hook that refuses autopar, a Hugging Face Llama built by a
factory that imports only transformers, planned from batch-1 example inputs as the README shows,
at tp=2 (+ sequence parallelism), pp=2 1F1B and dp=2 ZeRO-3: its losses equal one process's
(fp32, relative 1e-5: only the order of additions differs)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import plain_factories  # noqa: E402
from harness import free_port  # noqa: E402

STEPS, GLOBAL, LR = 2, 4, 1e-3
BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=4, zero=0, recompute="none", schedule="1f1b", virtual_stages=1,
            sequence_parallel=False)
CASES = {
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "pp2_1f1b": dict(pp=2, micro_batch_size=1),
    "dp2_zero3": dict(dp=2, zero=3, micro_batch_size=2),
}
REFUSE = '''import sys


class _RefuseAutopar:
    def find_spec(self, name, path=None, target=None):
        if name == "autopar" or name.startswith("autopar."):
            raise ImportError("autopar cannot be imported here (tests/distributed/test_standalone.py)")
        return None


sys.meta_path.insert(0, _RefuseAutopar())
'''


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    """A folder whose sitecustomize.py refuses autopar in every process started with it on PYTHONPATH."""
    folder = tmp_path_factory.mktemp("no_autopar")
    (folder / "sitecustomize.py").write_text(REFUSE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), HERE]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import autopar"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "cannot be imported here" in probe.stderr
    return env


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = plain_factories.llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**plain_factories.llama_batch(step, GLOBAL)).loss
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_standalone_program_trains_like_one_process(name, hook, reference, tmp_path):
    import autopar
    from autopar import Cluster
    torch.manual_seed(0)
    example = {k: v[:1] for k, v in plain_factories.llama_batch(0, GLOBAL).items()}
    plan = autopar.plan(plain_factories.llama(), Cluster.from_spec("1x2xcpu"), example, global_batch_size=GLOBAL,
                        fixed={**BASE, **CASES[name]}, verbose=False)
    script = autopar.codegen.emit(plan, tmp_path / "run", "plain_factories:llama",
                                  batch_factory="plain_factories:llama_batch", lr=LR, standalone=True)
    text = (tmp_path / "run" / "program.py").read_text()
    assert "import autopar" not in text and "class Chunk0(torch.nn.Module)" in text
    if "tp2" in name:
        assert "collectives.gather_partial(" in text and "collectives.reduce_scatter(" in text
    losses = tmp_path / "losses.txt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), str(script), "--steps", str(STEPS), "--loss-file", str(losses),
                          "--timeout", "120"], env=hook, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = [float(x) for x in losses.read_text().split()]
    assert len(got) == STEPS
    for g, w in zip(got, reference):
        assert math.isclose(g, w, rel_tol=1e-5), (got, reference)
