"""``emit(..., standalone=True)`` generates the folder from the model's shapes: a factory taking
``device`` builds on the meta device (``device="meta"``), so a model too large for this machine emits
(bench/standalone_emit.py: GPT-3 175B's, through the CLI's planned_model.py); one without builds as it
does, and the export is on meta either way; the constants its forward makes from data get their
values without weights (codegen/constants.py).
The folder is written all at once (codegen/folder.py): a failure midway leaves the output folder as it
was (or absent) and nothing beside it. tests/distributed/test_standalone.py trains what it writes."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

import autopar
from autopar import Cluster, ConfigError
from autopar.codegen import emit
from autopar.models import GPTConfig, build_gpt

CONFIG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=8)
FACTORIES = textwrap.dedent('''\
    import torch
    from torch import nn
    from autopar.models import GPTConfig, build_gpt

    CONFIG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=8)
    BUILT = []   # every model a factory built, to look at after emit


    def _meta_only(device):
        """A model too large for this machine: built anywhere but on the meta device, it fails."""
        if torch.device(device).type != "meta":
            raise MemoryError("the weights do not fit in this machine's memory")


    def gpt(device="cpu"):   # as autopar codegen's planned_model.build
        _meta_only(device)
        model, _ = build_gpt(CONFIG, device=device)
        BUILT.append(model)
        return model


    def on_cpu():   # takes no device: builds as it does (a small model), then moved to meta for the export
        model, _ = build_gpt(CONFIG, device="cpu")
        BUILT.append(model)
        return model


    def needs_an_argument(size):
        return gpt()


    class Signs(nn.Module):   # a forward that makes a tensor from data on its weight's device
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            signs = torch.tensor([1.0, -1.0] * 4, device=self.fc.weight.device)
            return {"loss": (self.fc(x) * signs).square().mean()}


    def signs(device="cpu"):
        with torch.device(device):
            return Signs()
    ''')


@pytest.fixture()
def factories(tmp_path, monkeypatch):
    (tmp_path / "emit_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("emit_factories", None)
    import emit_factories
    yield emit_factories
    sys.modules.pop("emit_factories", None)


@pytest.fixture(scope="module")
def tp_plan():
    model, inputs = build_gpt(CONFIG, device="meta")
    return autopar.plan(model, Cluster.from_spec("1x2xcpu"), inputs, global_batch_size=4,
                        fixed=dict(dp=1, tp=2, pp=1, micro_batch_size=2, zero=0, recompute="none",
                                   sequence_parallel=False), verbose=False)


def _entries(folder) -> list[str]:
    """The folder's entries but Python's bytecode cache (importing the factory file writes one beside it)."""
    return sorted(name for name in os.listdir(folder) if name != "__pycache__")


def _listing(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in _entries(folder) if (folder / name).is_file()}


@pytest.mark.parametrize("factory", ["gpt", "on_cpu"])
def test_the_model_is_exported_on_meta_and_a_device_taking_factory_never_builds_weights(tmp_path, factories,
                                                                                       tp_plan, factory):
    """gpt fails anywhere but on meta (a model too large for this machine); on_cpu's weights are moved
    to meta with the tied head kept tied (else the plan's structure check refuses the graph)."""
    emit(tp_plan, tmp_path / "run", f"emit_factories:{factory}", standalone=True)
    assert (tmp_path / "run" / "program.py").is_file() and (tmp_path / "run" / "train.py").is_file()
    (model,) = factories.BUILT
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))   # no value left meta during emit
    assert model.head.weight is model.embed.tok.weight
    text = (tmp_path / "run" / "program.py").read_text()
    assert "MODEL_FACTORY, BATCH_FACTORY, LR = 'emit_factories:" in text and "TP_DIMS = {" in text


def test_a_factory_train_py_cannot_call_bare_is_refused_by_name(tmp_path, factories, tp_plan):
    with pytest.raises(ConfigError, match=r"needs_an_argument \(size\) must be callable with no arguments"):
        emit(tp_plan, tmp_path / "run", "emit_factories:needs_an_argument", standalone=True)


def test_constants_the_forward_makes_on_meta_get_their_values(tmp_path, factories):
    """``torch.tensor(data, device=<the weight's>)`` is made on meta when the model is there: its value
    comes from a second export on fake CPU tensors (no weights), into buffers.pt."""
    plan = autopar.plan(factories.Signs(), Cluster.from_spec("1x1xcpu"), (torch.zeros(1, 8),), global_batch_size=4,
                        verbose=False)
    emit(plan, tmp_path / "run", "emit_factories:signs", standalone=True)
    saved = torch.load(tmp_path / "run" / "buffers.pt")
    assert [v.tolist() for v in saved.values()] == [[1.0, -1.0] * 4]


def test_a_failure_leaves_no_folder_and_nothing_beside_it(tmp_path, factories, tp_plan, monkeypatch):
    def broken(device):
        raise RuntimeError("broken factory")
    monkeypatch.setattr(factories, "_meta_only", broken)
    with pytest.raises(ConfigError, match='emit_factories:gpt fails with device="meta".*broken factory'):
        emit(tp_plan, tmp_path / "run", "emit_factories:gpt", standalone=True)
    assert _entries(tmp_path) == ["emit_factories.py"]


def test_a_re_emit_replaces_the_folder_only_on_success(tmp_path, factories, tp_plan, monkeypatch):
    """A failure midway (after the support files were copied) leaves the previous folder byte for byte;
    a successful re-emit replaces what it writes and keeps what else the folder holds (a checkpoint)."""
    import autopar.codegen.standalone as standalone
    run = tmp_path / "run"
    emit(tp_plan, run, "emit_factories:gpt", standalone=True)
    (run / "ckpt").mkdir()
    (run / "ckpt" / "step1").write_text("a checkpoint")
    before = _listing(run)
    other = autopar.plan(build_gpt(CONFIG, device="meta")[0], Cluster.from_spec("1x2xcpu"),
                         build_gpt(CONFIG, device="meta")[1], global_batch_size=4,
                         fixed=dict(dp=1, tp=1, pp=2, micro_batch_size=1, zero=0, recompute="none"), verbose=False)

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(standalone, "program_source", broken)
    with pytest.raises(OSError, match="disk full"):
        emit(other, run, "emit_factories:gpt", standalone=True)
    assert _listing(run) == before and _entries(tmp_path) == ["emit_factories.py", "run"]

    monkeypatch.undo()
    emit(other, run, "emit_factories:gpt", standalone=True)
    assert autopar.load_plan(run / "plan.json").config == other.config
    assert "DP, CP, TP, PP, DEVICES = 1, 1, 1, 2, 2" in (run / "program.py").read_text()
    assert (run / "ckpt" / "step1").read_text() == "a checkpoint"
    assert _entries(tmp_path) == ["emit_factories.py", "run"]


def test_the_cli_builds_its_planned_model_on_meta_and_writes_nothing_on_failure(tmp_path, monkeypatch, capsys):
    """``autopar codegen PLAN -o OUT --standalone`` (the README's flow for GPT-3 175B): planned_model.build
    is given device="meta" for the export; a refused plan leaves no OUT and nothing beside it."""
    import dataclasses

    from autopar.cli import main
    from autopar.models import registry
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "gpt-tiny", "--cluster", "1x2xcpu", "--global-batch", "4", "--fixed", "tp=2", "-o", "p.json",
                 "-q"]) == 0
    real, devices = registry.build, []

    def build(name, **kwargs):   # the registry's model, too large for this machine anywhere but on meta
        devices.append(str(kwargs["device"]))
        if devices[-1] != "meta":
            raise MemoryError("the weights do not fit in this machine's memory")
        return real(name, **kwargs)
    monkeypatch.setattr(registry, "build", build)
    assert main(["codegen", "p.json", "-o", "run", "--standalone"]) == 0
    assert devices == ["meta"]
    assert {"program.py", "train.py", "plan.json", "planned_model.py"} <= set(os.listdir(tmp_path / "run"))
    assert 'def build(device="cpu"):' in (tmp_path / "run" / "planned_model.py").read_text()

    plan = autopar.load_plan(tmp_path / "p.json")
    dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, kernels="fused")).save(tmp_path / "f.json")
    capsys.readouterr()
    assert main(["codegen", "f.json", "-o", "fused", "--standalone"]) == 2
    assert "cannot run hand-written fused kernels" in capsys.readouterr().err
    # four micro-batches' gradients priced as accumulated inside the GEMMs: the folder adds them by autograd
    assert main(["plan", "gpt-tiny", "--cluster", "1x2xcpu", "--global-batch", "4", "--fixed",
                 "tp=2,micro_batch_size=1", "-o", "g.json", "-q"]) == 0
    four = autopar.load_plan(tmp_path / "g.json")
    assert four.micro_batches == 4
    dataclasses.replace(four, precision=dataclasses.replace(four.precision, grad_accumulation="fused")).save(
        tmp_path / "g.json")
    capsys.readouterr()
    assert main(["codegen", "g.json", "-o", "acc", "--standalone"]) == 2
    assert "Precision(grad_accumulation='autograd')" in capsys.readouterr().err
    (tmp_path / "g.json").unlink()
    assert sorted(os.listdir(tmp_path)) == ["f.json", "p.json", "run"]
