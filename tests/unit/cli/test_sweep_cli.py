"""``autopar sweep``, in-process (``autopar.cli.main``): the table, its exports, the saved plans, and the
errors a user can fix. gpt-tiny on nodes of 2 A100s keeps it to a second; bench/sweep.py times llama3-70b."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os

import pytest

import autopar
from autopar.cli import main
from autopar.cli.sweep import count, node_counts

ARGS = ["sweep", "gpt-tiny", "--nodes", "2,1", "--device", "A100-80GB", "--devices-per-node", "2", "--workers", "1",
        "-q"]


def run(capsys, cwd, *args: str) -> tuple[int, str, str]:
    here = os.getcwd()
    os.chdir(cwd)
    try:
        code = main(list(args))
    finally:
        os.chdir(here)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_sweep_prints_the_table_and_writes_its_exports(capsys, tmp_path) -> None:
    code, out, err = run(capsys, tmp_path, *ARGS, "--global-batch-tokens", "256", "--tokens", "1B",
                         "--price-per-gpu-hour", "2.5", "--plot", "s.png", "--csv", "s.csv", "--save-plans", "plans")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("autopar sweep of gpt-tiny on nodes of 2 x A100-80GB: global batch 8 x 32 tokens")
    assert [line.split()[:2] for line in lines[2:4]] == [["1", "2"], ["2", "4"]]
    assert any(line.startswith("MFU = model FLOPs per step") for line in lines)
    assert "chart written to s.png" in out and "table written to s.csv" in out
    assert (tmp_path / "s.png").stat().st_size > 0
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    for r in rows:       # tokens/s x time = tokens; cost = GPUs x hours x price
        assert math.isclose(float(r["tokens_per_s"]) * float(r["train_s"]), 1e9, rel_tol=1e-12)
        assert math.isclose(float(r["cost"]), int(r["gpus"]) * float(r["train_s"]) / 3600 * 2.5, rel_tol=1e-12)
    assert sorted(os.listdir(tmp_path / "plans")) == ["1x2xA100-80GB.json", "2x2xA100-80GB.json"]
    saved = autopar.load_plan(tmp_path / "plans" / "2x2xA100-80GB.json")
    assert saved.model_name == "gpt-tiny" and saved.extra["model"]["model"] == "gpt-tiny"
    assert saved.cluster.nodes == 2 and saved.config.short() in lines[3]
    code, shown, _ = run(capsys, tmp_path, "show", "plans/2x2xA100-80GB.json")   # show prints tokens/s too
    assert code == 0 and f"({saved.tokens_per_second / 1e3:.4g}k tokens/s)" in shown


def test_sweep_json(capsys, tmp_path) -> None:
    code, out, _ = run(capsys, tmp_path, *ARGS, "--global-batch", "8", "--json")
    data = json.loads(out)
    assert code == 0 and data["model"] == "gpt-tiny" and data["global_batch_size"] == 8
    assert [r["nodes"] for r in data["rows"]] == [1, 2] and data["tokens"] is None and data["rows"][0]["cost"] is None


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-tokens", "250"], "not a whole number of 32-token sequences: use 224"),
    (["--global-batch", "8", "--price-per-gpu-hour", "2"], "give tokens too"),
    (["--global-batch", "8", "--fixed", "tq=2"], "unknown field 'tq'"),
])
def test_errors_a_user_can_fix(capsys, tmp_path, extra, message) -> None:
    code, out, err = run(capsys, tmp_path, *ARGS, *extra)
    assert code == 2 and out == "" and err.startswith("autopar sweep: ") and message in err


def test_unknown_device(capsys, tmp_path) -> None:
    code, _, err = run(capsys, tmp_path, "sweep", "gpt-tiny", "--nodes", "1", "--device", "B300", "--global-batch", "8")
    assert code == 2 and "unknown device 'B300'" in err


@pytest.mark.parametrize("bad", [["--nodes", "1,x"], ["--nodes", "0,1"], ["--tokens", "lots"],
                                 ["--global-batch", "8", "--global-batch-tokens", "256"]])
def test_argument_errors(capsys, bad) -> None:
    args = ["sweep", "gpt-tiny", "--device", "A100-80GB", *bad]
    if "--nodes" not in bad:
        args += ["--nodes", "1"]
    if not any(b.startswith("--global-batch") for b in bad):
        args += ["--global-batch", "8"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    capsys.readouterr()


def test_counts() -> None:
    assert count("1e12") == 1e12 and count("15T") == 15e12 and count("4M") == 4e6 and count("2.5B") == 2.5e9
    assert count("1k") == 1e3 and count("2.5") == 2.5 and count(" 3 g ") == 3e9
    for bad in ("abc", "-1", "0", "1.2.3", "inf", "1e999", "5X"):
        with pytest.raises(argparse.ArgumentTypeError):
            count(bad)
    assert node_counts("1,2, 4") == [1, 2, 4]
