"""Plan: summary text, JSON form, atomic save."""

from __future__ import annotations

import json
import os

import pytest

import autopar
from autopar import Cluster, ParallelConfig, Plan
from autopar.cost_model import estimate_plan
from autopar.report.format import BREAKDOWN_LABELS, OPTIONAL_BREAKDOWN, seconds

ONE_NODE = Cluster.from_spec("1x8xA100-80GB")


@pytest.fixture(scope="module")
def plan(plan_graph) -> Plan:
    cfg = ParallelConfig(dp=2, pp=4, schedule="interleaved", virtual_stages=2, zero=1, recompute="selective")
    return estimate_plan(plan_graph, ONE_NODE, cfg, 64)


def test_summary(plan) -> None:
    text = plan.summary()
    assert str(plan) == text
    assert plan.config.short() in text
    assert f"step time      {seconds(plan.step_time)}" in text
    assert plan.model_name in text and "A100-80GB" in text
    # One row per stage: index, five memory columns, total, share of the device, in-flight, layers.
    rows = [line.split() for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [s.index for s in plan.stages] == list(range(plan.config.pp))
    for row, stage in zip(rows, plan.stages):
        assert float(row[6]) == pytest.approx(stage.memory.total / 1e9, abs=0.006)  # printed with 2 decimals
        assert int(row[8]) == stage.in_flight
        assert row[9] == stage.layers[0]
        assert len(stage.chunks) == 2 and all(chunk[0] in row[9:] for chunk in stage.chunks)  # one span per chunk
    # Every breakdown component is listed with its time (tests/unit/report checks the shares).
    for name, label in BREAKDOWN_LABELS.items():
        if name in OPTIONAL_BREAKDOWN and not getattr(plan.breakdown, name):   # shown only when a plan has it
            assert not any(line.startswith(f"  {label} ") for line in text.splitlines())
            continue
        assert any(line.startswith(f"  {label} ") and seconds(getattr(plan.breakdown, name)) in line
                   for line in text.splitlines())


def test_repr_is_one_line(plan) -> None:
    text = repr(plan)
    assert text == (f"Plan(model_name={plan.model_name!r}, cluster='1x8xA100-80GB', config={plan.config.short()!r}, "
                     f"step_time={plan.step_time:.6g}, fits={plan.fits})")
    assert "\n" not in text and len(text) < 200 and str(plan) == plan.summary()


def test_to_dict_is_json_native(plan) -> None:
    data = plan.to_dict()
    assert next(iter(data)) == "schema_version"
    assert json.loads(plan.to_json()) == data
    assert Plan.from_dict(data) == plan


def test_save_then_load(plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    plan.save(path)
    assert autopar.load_plan(path) == plan
    assert os.listdir(tmp_path) == ["plan.json"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_save_has_the_permissions_of_a_plain_write(plan, tmp_path, umask) -> None:
    """Plan.save (and the exports' and profile cache's writes, which share files.write_atomic) give the file
    the mode open() gives a new file under the umask (0644 under the usual 022), not mkstemp's 0600."""
    from autopar.profiler.database import ProfileDB
    previous = os.umask(umask)
    try:
        plan.save(tmp_path / "plan.json")
        plan.export("deepspeed", tmp_path / "ds.json")
        db = ProfileDB(tmp_path / "profile.json")
        db.put("cpu", "ops", "k", {"seconds": 1.0})
        db.save()
        with open(tmp_path / "plain.txt", "w"):
            pass
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    assert os.stat(tmp_path / "plain.txt").st_mode & 0o777 == expected
    for name in ("plan.json", "ds.json", "profile.json"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == expected, name
    assert sorted(os.listdir(tmp_path)) == ["ds.json", "plain.txt", "plan.json", "profile.json"]


class _FailingFile:
    """A file object that writes the first half of what it is given, then fails (disk full)."""

    def __init__(self, fh) -> None:
        self._fh = fh
        self.written = 0

    def write(self, text: str) -> int:
        half = text[: len(text) // 2]
        self._fh.write(half)
        self._fh.flush()
        self.written += len(half)
        raise OSError(28, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


def test_save_is_atomic(plan, tmp_path, monkeypatch) -> None:
    path = tmp_path / "plan.json"
    path.write_text("previous plan")
    real_fdopen = os.fdopen
    opened: list[_FailingFile] = []

    def failing_fdopen(fd, *args, **kwargs):
        opened.append(_FailingFile(real_fdopen(fd, *args, **kwargs)))
        return opened[-1]

    monkeypatch.setattr(os, "fdopen", failing_fdopen)
    with pytest.raises(OSError, match="No space left"):
        plan.save(path)
    monkeypatch.undo()
    assert opened and opened[0].written > 0  # the failure really happened midway through the write
    assert path.read_text() == "previous plan"
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary file left behind


def test_save_atomic_when_serialisation_fails(plan, tmp_path, monkeypatch) -> None:
    path = tmp_path / "plan.json"
    path.write_text("previous plan")

    def broken(*args, **kwargs):
        raise TypeError("Object of type X is not JSON serializable")

    monkeypatch.setattr(json, "dumps", broken)
    with pytest.raises(TypeError):
        plan.save(path)
    monkeypatch.undo()
    assert path.read_text() == "previous plan"
    assert os.listdir(tmp_path) == ["plan.json"]
