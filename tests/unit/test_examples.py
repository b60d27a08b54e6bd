"""examples/quickstart.py runs as the README says, and makes what it says it makes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
