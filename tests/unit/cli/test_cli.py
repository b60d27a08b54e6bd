"""The ``autopar`` command, run as a subprocess from a temporary directory (as a user would).

A subprocess pays the torch import (about 2 s), so the cases are few and each checks a lot: the
commands that plan run as subprocesses, and the ones that read what they wrote (``show``,
``codegen``, ``compare``) run in-process through ``autopar.cli.main`` (the same code from argv on).
Argument errors are checked in-process too (argparse and our parsing). A factory model's codegen
(its ``planned_model.py`` and a script byte-equal to ``codegen.emit``'s, which runs under torchrun)
is tests/distributed/test_emit.py's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import py_compile
import re
import subprocess
import sys
import textwrap

import pytest

import autopar
from autopar.cli import main
from autopar.cli.models import parse_fields

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
    [os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def autopar_cmd(cwd, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"autopar {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def autopar_main(capsys, cwd, *args: str) -> str:
    """``autopar ARGS`` in this process from ``cwd``: its standard output (exit status 0 asserted)."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        code = main(list(args))
    finally:
        os.chdir(here)
    out = capsys.readouterr()
    assert code == 0, f"autopar {' '.join(args)} exited {code}:\n{out.out}\n{out.err}"
    return out.out


def _config_line(summary: str) -> str:
    match = re.search(r"^  configuration  (.+)$", summary, re.M)
    assert match, summary
    return match.group(1)


# GPT-2 small with tp and pp pinned (a pipelined plan to draw), BERT-base free: registry models whose
# capture takes a few seconds (bench/cli_plan_time.py times the 96-layer GPT-3 175B's whole search)
@pytest.mark.parametrize("model, cluster, batch, fixed", [("gpt2-small", "1x8xA100-80GB", "64", "tp=2,pp=4"),
                                                          ("bert-base", "1x8xH100-SXM", "64", None)])
def test_plan_show_codegen(tmp_path, capsys, model, cluster, batch, fixed):
    pins = ("--fixed", fixed) if fixed else ()
    plan_out = autopar_main(capsys, tmp_path, "plan", model, "--cluster", cluster, "--global-batch", batch, "-o",
                            "p.json", "--explain", *pins)   # in this process: test_user_errors_exit_2 runs the command
    plan = autopar.load_plan(tmp_path / "p.json")
    assert plan.model_name == model and plan.global_batch_size == int(batch) and plan.fits and plan.optimal
    assert plan.extra["model"] == {"model": model, "seq_len": None, "dtype": "bf16"}
    assert plan.devices == autopar.Cluster.from_spec(cluster).devices
    summary = plan.summary()
    assert plan_out.startswith(summary), "plan prints the saved plan's summary first"
    assert _config_line(plan_out) == plan.config.short()
    assert "Runners-up and why each lost:" in plan_out and "The choices:" in plan_out

    show = autopar_main(capsys, tmp_path, "show", "p.json", "--timeline", "t.png", "--memory", "m.png")
    assert show.startswith(summary)
    for png in ("t.png", "m.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    as_json = json.loads(autopar_main(capsys, tmp_path, "show", "p.json", "--json"))
    assert as_json == plan.to_dict()

    gen = autopar_main(capsys, tmp_path, "codegen", "p.json", "-o", "out")
    for name in ("train.py", "plan.json", "planned_model.py"):
        py_compile.compile(str(tmp_path / "out" / name), doraise=True) if name.endswith(".py") else None
        assert (tmp_path / "out" / name).is_file(), gen
    script = (tmp_path / "out" / "train.py").read_text()
    cfg = plan.config
    assert f"DP, CP, TP, PP, EP = {cfg.dp}, {cfg.cp}, {cfg.tp}, {cfg.pp}, {cfg.ep}" in script
    assert f"registry.build({model!r}" in (tmp_path / "out" / "planned_model.py").read_text()
    assert autopar.load_plan(tmp_path / "out" / "plan.json").to_dict() == plan.to_dict()
    assert f"--nproc-per-node {min(plan.devices, 8)}" in gen


def test_estimate_compare_and_a_factory_model(tmp_path, capsys):
    """estimate with --config; a user's package.module:factory; compare; and codegen's planned_model.py,
    which builds the factory's model on the CPU."""
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""\
        from autopar.models import GPTConfig, build_gpt

        def tiny(device):
            return build_gpt(GPTConfig(vocab_size=128, hidden=32, heads=2, layers=2, seq_len=16), device=device)
        """))
    est = autopar_main(capsys, tmp_path, "estimate", "mymodels:tiny", "--cluster", "1x2xcpu", "--global-batch", "8",
                       "--config", "pp=2,mbs=2,schedule=gpipe", "-o", "est.json")
    assert _config_line(est) == "dp=1 tp=1 pp=2 mb=2 gpipe zero=0 recompute=none"
    autopar_main(capsys, tmp_path, "plan", "mymodels:tiny", "--cluster", "1x2xcpu", "--global-batch", "8", "-o",
                 "best.json")
    best, estimate = autopar.load_plan(tmp_path / "best.json"), autopar.load_plan(tmp_path / "est.json")
    assert best.model_name == "mymodels:tiny" and estimate.optimal is None

    cmp_ = autopar_main(capsys, tmp_path, "compare", "best.json", "est.json")
    marked = {line[2:].split("  ")[0].strip() for line in cmp_.splitlines() if line.startswith("* ")}
    names = {f.name for f in dataclasses.fields(autopar.ParallelConfig)}
    differing = {n for n in names if getattr(best.config, n) != getattr(estimate.config, n)}
    assert {"pp", "schedule"} <= differing and marked & names == differing, cmp_
    assert "model" not in marked and "cluster" not in marked and "step time" in marked
    faster = "A" if best.step_time < estimate.step_time else "B"
    assert f"{faster} is faster" in cmp_

    autopar_main(capsys, tmp_path, "codegen", "best.json", "-o", "run")
    sys.path.insert(0, str(tmp_path / "run"))
    sys.path.insert(0, str(tmp_path))
    try:
        import planned_model
        model = planned_model.build()
    finally:
        del sys.path[:2]
        sys.modules.pop("planned_model", None)
        sys.modules.pop("mymodels", None)
    assert type(model).__name__ == "GPT" and next(model.parameters()).device.type == "cpu"


def test_user_errors_exit_2_with_one_line(tmp_path):
    proc = autopar_cmd(tmp_path, "plan", "no-such-model", "--cluster", "1x2xcpu", "--global-batch", "4", check=False)
    assert proc.returncode == 2 and "unknown model 'no-such-model'" in proc.stderr and "gpt2-small" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_on_every_command(capsys):
    commands = ("plan", "estimate", "show", "compare", "codegen", "profile", "models", "demo")
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    top = capsys.readouterr().out
    for command in commands:
        assert command in top
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert f"usage: autopar {command}" in capsys.readouterr().out


def test_help_imports_no_torch(tmp_path):
    """`autopar --help` and every command's --help build their parsers without importing torch (or numpy,
    matplotlib): the help is a fraction of a second, not the torch import's seconds."""
    code = textwrap.dedent("""\
        import sys
        from autopar.cli import main, parser
        commands = [a for a in parser()._subparsers._group_actions[0].choices]
        for argv in [[], *([c] for c in commands)]:
            try:
                main([*argv, "--help"])
            except SystemExit as exc:
                assert exc.code == 0, argv
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "matplotlib"))
        print(len(commands), heavy[:5], file=sys.stderr)
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip() == "10 []", proc.stderr
    assert "usage: autopar export" in proc.stdout and "usage: autopar sweep" in proc.stdout


def test_in_process_errors(tmp_path, capsys):
    assert main(["estimate", "gpt-tiny", "--cluster", "1x2xcpu", "--global-batch", "4", "--config", "tp=2,bogus=1"]) == 2
    assert "unknown field 'bogus'" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "cannot read plan file" in capsys.readouterr().err
    assert main(["estimate", "gpt-tiny", "--cluster", "1x2xcpu", "--global-batch", "4", "--config", "tp=two"]) == 2
    assert "tp='two' must be an integer" in capsys.readouterr().err
    assert main(["codegen", str(_plan_without_model(tmp_path)), "-o", str(tmp_path / "o")]) == 2
    assert "--model-factory" in capsys.readouterr().err
    assert main(["models"]) == 0
    assert "gpt3-175b" in capsys.readouterr().out


def _plan_without_model(tmp_path):
    model, inputs = autopar.models.build("gpt-tiny")
    plan = autopar.estimate(model, autopar.Cluster.from_spec("1x2xcpu"), inputs, autopar.ParallelConfig(dp=2),
                            global_batch_size=4)
    plan.save(tmp_path / "api.json")
    return tmp_path / "api.json"


def test_parse_fields():
    assert parse_fields("dp=16,tp=8,pp=8,mbs=1,schedule=interleaved,v=2,recompute=full,sp=true", "--config") == {
        "dp": 16, "tp": 8, "pp": 8, "micro_batch_size": 1, "schedule": "interleaved", "virtual_stages": 2,
        "recompute": "full", "sequence_parallel": True}
    assert parse_fields("stage_recompute=full/none", "--fixed") == {"stage_recompute": ("full", "none")}
    for bad in ("tp", "tp=", "sp=maybe", "zero=1.5"):
        with pytest.raises(autopar.ConfigError):
            parse_fields(bad, "--fixed")


def test_dtype_sets_the_precision_the_plan_prices(tmp_path, capsys):
    """--dtype builds the model in that dtype and prices the plan in it (a GPU plan is bf16 by default): the program
    runs the model as built and refuses a plan priced in another dtype (codegen/compile.py check_weights_dtype)."""
    for dtype, want in ((None, "bf16"), ("fp32", "fp32")):
        extra = ["--dtype", dtype] if dtype else []
        plan = json.loads(autopar_main(capsys, tmp_path, "estimate", "gpt-tiny", "--cluster", "1x2xH100-SXM",
                                       "--global-batch", "4", "--config", "dp=2", "--json", *extra))
        assert plan["precision"]["compute"] == plan["precision"]["grads"] == want
        assert plan["extra"]["model"]["dtype"] == want
