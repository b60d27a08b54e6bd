"""The script codegen.emit writes runs under torchrun on 2 CPU ranks and trains like one process; the
command-line flow ``autopar plan`` -> ``autopar codegen`` on a Hugging Face factory that takes ``device``
(planned on the meta device from batch-1 inputs) writes that same script and a model module that builds
the model with real weights."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import LR, MODELS, Case, batches, call_loss, free_port, make_plan  # noqa: E402

import autopar  # noqa: E402
import autopar.codegen  # noqa: E402

STEPS = 2
CLIP = 0.01   # --clip-grad: below the gradients' norm (every step clipped, as one process clips them)
HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(os.path.dirname(HERE))]),
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _torchrun(script, losses, *args: str) -> list[float]:
    """Rank 0's losses of ``STEPS`` steps of ``script`` on 2 ranks."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(script), "--steps", str(STEPS), "--loss-file",
                          str(losses), "--timeout", "120", *args], env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [float(x) for x in losses.read_text().split()]


def _assert_trains_like_one_process(got: list[float], model, step_loss, clip: float | None = None) -> None:
    """``got`` are the losses of STEPS AdamW steps of ``model`` in one process, ``step_loss(model, step)``
    each, the gradients clipped to a total norm of ``clip`` where given (fp32, additions reordered only:
    relative 1e-5)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    want = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = step_loss(model, step)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        want.append(loss.item())
    assert len(got) == STEPS
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-5), (got, want)


def test_emitted_script_trains_like_one_process(tmp_path):
    case = Case("emit", "gpt2", dict(dp=1, tp=1, pp=2, micro_batch_size=1, zero=0, recompute="none",
                                     schedule="1f1b", virtual_stages=1, sequence_parallel=False), 2)
    plan = make_plan(case)
    script = autopar.codegen.emit(plan, tmp_path, "factories:gpt2_model", batch_factory="factories:gpt2_batch",
                                  lr=LR)
    text = open(script).read()
    assert "CHUNK_LAYERS" in text and "SCHEDULE" in text and "F0.0" in text
    got = _torchrun(script, tmp_path / "losses.txt", "--checkpoint", str(tmp_path / "ckpt"), "--save-every", "1",
                    "--clip-grad", str(CLIP))
    _assert_trains_like_one_process(got, MODELS["gpt2"](), lambda model, step: call_loss(
        model, batches("gpt2", step + 1, case.global_batch)[step], None), clip=CLIP)
    _assert_checkpoints_resume(tmp_path / "ckpt", got)
    # each pipeline stage wrote the code it runs (test_source.py checks such source against what runs)
    written = sorted(os.listdir(tmp_path / "program"))
    assert written == ["autopar_runtime", "stage0.py", "stage1.py"], written
    assert "class Layer_transformer_h_0(torch.nn.Module)" in (tmp_path / "program" / "stage0.py").read_text()


def _assert_checkpoints_resume(folder, got: list[float]) -> None:
    """``--checkpoint DIR --save-every 1`` wrote DIR/step<N> after every step; the first, loaded in one
    process (model and AdamW state), takes the second step as the script did (clipped alike): the same loss, and the
    parameters of the second checkpoint (an AdamW step moves
    each element by about lr = 1e-3; observed 7e-8)."""
    assert sorted(os.listdir(folder)) == [f"step{n:08d}" for n in range(1, STEPS + 1)]
    model, after = MODELS["gpt2"](), MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert autopar.load_checkpoint(folder / "step00000001", model, opt) == 1
    assert autopar.load_checkpoint(folder / f"step{STEPS:08d}", after) == STEPS
    loss = call_loss(model, batches("gpt2", 2, 4)[1], None)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    assert math.isclose(loss.item(), got[1], rel_tol=1e-5), (loss.item(), got[1])
    want = dict(after.named_parameters())
    diff = max((p - want[n]).abs().max().item() for n, p in model.named_parameters())
    assert diff <= 1e-5, diff


def test_cli_plan_codegen_on_a_hugging_face_factory(tmp_path):
    """The README's command-line flow on a factory that builds HF Llama from its config on ``device``:
    ``autopar plan`` plans it on the meta device from batch-1 inputs; ``autopar codegen`` writes
    ``planned_model.py``, which builds it with real weights on the CPU, and the training script
    ``codegen.emit`` writes for that factory, byte for byte. That script runs under torchrun in the
    test above, and on a Hugging Face factory taking ``device`` in tests/unit/test_examples.py (the
    CPU quickstart): a third torchrun here took 25 s alone and 150 s beside the unit tests."""
    import importlib.util

    import factories

    def autopar_cli(*args: str) -> None:
        command = os.path.join(os.path.dirname(sys.executable), "autopar")   # the installed console script
        run = subprocess.run([command, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    autopar_cli("plan", "factories:llama_from_config", "--cluster", "1x2xcpu", "--global-batch", "4",
                "--fixed", "dp=1,tp=2,pp=1,mbs=2,zero=0,recompute=none", "-q", "-o", "plan.json")
    autopar_cli("codegen", "plan.json", "-o", "run", "--batch-factory", "factories:llama_batch", "--lr", str(LR))
    plan = autopar.load_plan(tmp_path / "plan.json")
    assert plan.config.tp == 2 and plan.extra["inputs"]["kwargs"]["input_ids"]["shape"][0] == 1
    api = autopar.codegen.emit(plan, tmp_path / "api", "planned_model:build", batch_factory="factories:llama_batch",
                               lr=LR)
    assert (tmp_path / "run" / "train.py").read_text() == open(api).read()
    spec = importlib.util.spec_from_file_location("planned_model", tmp_path / "run" / "planned_model.py")
    planned = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planned)
    got = planned.build().state_dict()
    torch.manual_seed(0)   # what build() seeds: the same weights on every rank
    want = factories.llama_from_config("cpu")[0].state_dict()
    assert set(got) == set(want)
    assert all(v.device.type == "cpu" and torch.equal(v, want[k]) for k, v in got.items())
