"""Error bars come from the recorded validation residuals (plan/interval.py): a different file gives the
interval of its own percentiles, a family with too few rows takes all rows (and says so), and a device no
validation run covers gets none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autopar.errors import PlanFormatError
from autopar.plan import interval

FAMILIES = {"A100-80GB": "A100", "A100-40GB": "A100", "H100-SXM": "H100", "V100-32GB": "V100"}


def write_residuals(path, monkeypatch, errors: dict[str, list[float]], sweeps: dict[str, str] | None = None):
    """A residuals file of ``errors`` per device (rows named d0, d1, ...) made the one autopar reads."""
    rows = [dict(id=f"{device}-{i}", source="test", device=device, family=FAMILIES[device],
                 sweep=(sweeps or {}).get(f"{device}-{i}"), error=e)
            for device, es in errors.items() for i, e in enumerate(es)]
    path.write_text(json.dumps(dict(schema=interval.RESIDUALS_SCHEMA, description="test", families=FAMILIES,
                                    rows=rows)))
    monkeypatch.setattr(interval, "RESIDUALS_PATH", path)
    return rows


def expected(step: float, errors: list[float]) -> tuple[float, float]:
    """measured = predicted / (1 + e): the 90th percentile error bounds it from below."""
    lo, hi = np.percentile(errors, [10, 90])
    return step / (1 + hi), step / (1 + lo)


@pytest.mark.parametrize("errors", [[-0.30, -0.2, -0.1, -0.05, 0.0, 0.02, 0.05, 0.1, 0.2, 0.4],
                                    [0.01 * k for k in range(12)]])
def test_interval_is_the_recorded_residuals_percentiles(tmp_path, monkeypatch, errors) -> None:
    write_residuals(tmp_path / "r.json", monkeypatch, {"A100-80GB": errors, "H100-SXM": [0.9] * 8})
    for device in ("A100-80GB", "A100-40GB"):          # one family: the same rows
        iv = interval.step_interval(device, 10.0)
        assert iv.known and (iv.low, iv.high) == pytest.approx(expected(10.0, errors), rel=1e-12)
        assert iv.basis.startswith(f"A100: {len(errors)} published validation runs")
    assert interval.step_interval("H100-SXM", 10.0).low == pytest.approx(10 / 1.9)   # its own family's rows
    assert interval.step_interval("A100-80GB", 3.0).scale(7.0) == pytest.approx(
        tuple(7.0 * b / 10.0 for b in expected(10.0, errors)))


def test_too_few_rows_take_all_rows_and_an_uncovered_device_gets_none(tmp_path, monkeypatch) -> None:
    a100 = [0.01 * k - 0.05 for k in range(10)]
    h100 = [0.3, 0.35]                                   # under MIN_ROWS
    write_residuals(tmp_path / "r.json", monkeypatch, {"A100-80GB": a100, "H100-SXM": h100})
    for device, own in (("H100-SXM", "only 2"), ("V100-32GB", "none")):
        iv = interval.step_interval(device, 2.0)
        assert (iv.low, iv.high) == pytest.approx(expected(2.0, a100 + h100), rel=1e-12)
        assert iv.basis.startswith("all 12 published validation runs") and f"has {own} of its own" in iv.basis
    for device in ("cpu", "NVIDIA H100 80GB HBM3"):     # the CPU preset, a measured profile
        iv = interval.step_interval(device, 2.0)
        assert not iv.known and iv.low is None and iv.scale(5.0) is None
        assert f"no published validation run covers {device!r}" in iv.basis


def test_ratio_interval_pairs_within_a_sweep_or_independent_rows(tmp_path, monkeypatch) -> None:
    errors = [-0.2, -0.1, 0.0, 0.05, 0.1, 0.15, 0.3, -0.05, 0.2]
    sweeps = {f"A100-80GB-{i}": ("s1" if i < 4 else "s2" if i < 8 else None) for i in range(9)}
    rows = write_residuals(tmp_path / "r.json", monkeypatch, {"A100-80GB": errors}, sweeps)
    in_sweep = [(1 + a["error"]) / (1 + b["error"]) for a in rows for b in rows
                if a is not b and a["sweep"] is not None and a["sweep"] == b["sweep"]]
    assert len(in_sweep) == 2 * 4 * 3
    same = interval.ratio_interval("A100-80GB", 10.0, "A100-40GB", 9.0, same_model=True)
    lo, hi = np.percentile(in_sweep, [10, 90])            # measured B / A = 0.9 x (1 + e_a) / (1 + e_b)
    assert (same.low, same.high) == pytest.approx((0.9 * lo, 0.9 * hi), rel=1e-12) and same.predicted == 0.9
    assert "24 ordered pairs" in same.basis and "2 sweeps" in same.basis
    independent = [(1 + a["error"]) / (1 + b["error"]) for a in rows for b in rows if a is not b]
    other = interval.ratio_interval("A100-80GB", 10.0, "A100-80GB", 9.0, same_model=False)
    lo, hi = np.percentile(independent, [10, 90])
    assert (other.low, other.high) == pytest.approx((0.9 * lo, 0.9 * hi), rel=1e-12)
    assert "independent" in other.basis
    assert interval.ratio_interval("cpu", 1.0, "A100-80GB", 1.0, same_model=True) is None


@pytest.mark.parametrize("content", ["{", json.dumps({"schema": 99}), json.dumps(
    {"schema": 1, "description": "", "families": {}, "rows": [{"id": "x", "source": "s", "device": "d",
                                                              "family": "f", "sweep": None, "error": -1.5}]})])
def test_a_bad_residuals_file_says_how_to_rewrite_it(tmp_path, monkeypatch, content) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    monkeypatch.setattr(interval, "RESIDUALS_PATH", path)
    with pytest.raises(PlanFormatError, match="--write-residuals"):
        interval.step_interval("A100-80GB", 1.0)


def test_the_shipped_residuals_cover_the_gpu_presets() -> None:
    """The file bench/fidelity_split.py --write-residuals wrote: every GPU preset mapped to a family, and the
    two families with published validation sweeps hold enough rows of their own."""
    from autopar.presets import DEVICE_PRESETS
    data = interval.residuals()
    assert set(data.families) == set(DEVICE_PRESETS) - {"cpu"}
    for family in ("A100", "H100"):
        assert len(data.of_family(family)) >= interval.MIN_ROWS
    assert all(r.error > -1 for r in data.rows)
