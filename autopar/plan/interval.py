"""Error bars: a predicted step time's interval, read from the cost model's recorded out-of-sample errors.

``residuals.json`` (next to this file) holds the signed error ``e = predicted / measured - 1`` of every
*validation* row of bench/data/published_runs.json (sources no constant or mechanism was chosen on,
bench/data/split.json), as ``bench/fidelity_split.py --write-residuals`` priced them; that bench fails
when the file no longer matches what the cost model predicts. Nothing here is fitted or assumed: a run
that the model predicts at ``t`` measured ``t / (1 + e)``, so the central ``COVERAGE`` interval of the
measured step is ``t / (1 + e_hi)`` to ``t / (1 + e_lo)`` with ``e_lo``, ``e_hi`` the residuals' 10th
and 90th percentiles (linear interpolation).

Which residuals: those of the plan's device family when it has at least ``MIN_ROWS`` validation rows
(the file's ``families`` maps every GPU preset to its family); a GPU preset with fewer (V100, H200, the
power-capped H100) gets the interval of all validation rows, labelled as such, since it is priced by the
same model and kind of constants; a device the file does not list (the CPU preset's placeholders, a
profile ``Cluster.local`` measured) gets none: no published run says how wrong the model is there.

Two predictions compared (:func:`ratio_interval`): the measured ratio of their step times is the
predicted ratio times ``(1 + e_b) / (1 + e_a)``. For two plans of one model on one device family the
errors are correlated (the same constants misprice the same layers), so the factor's distribution is
that of pairs of configurations measured in one validation sweep (one model and cluster, several
configurations); otherwise the errors are taken as independent: pairs of rows of the two families.

Intervals are derived where a plan is read, never stored in a plan: a plan file stays what it was.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import PlanFormatError

RESIDUALS_PATH = Path(__file__).resolve().parent / "residuals.json"
"""The recorded validation residuals (bench/fidelity_split.py --write-residuals writes it)."""

RESIDUALS_SCHEMA = 1
COVERAGE = 0.8
"""The central share of validation runs an interval holds (between the 10th and 90th percentiles)."""
MIN_ROWS = 8
"""Validation rows a device family needs for its own interval; with fewer, all rows'."""
REWRITE = "rerun `python bench/fidelity_split.py --write-residuals`"


@dataclass(frozen=True)
class Residual:
    """One validation row's signed error, predicted / measured - 1 (positive: predicted slower)."""

    id: str
    source: str
    device: str                 # the preset the row's cluster used, e.g. "A100-80GB"
    family: str                 # its device family, e.g. "A100"
    sweep: str | None           # the validation sweep it belongs to (one model and cluster), if any
    error: float


@dataclass(frozen=True)
class Residuals:
    """The recorded validation residuals and how they were made."""

    description: str
    families: Mapping[str, str]   # GPU preset name -> the family whose residuals price it
    rows: tuple[Residual, ...]

    def of_family(self, family: str) -> tuple[Residual, ...]:
        return tuple(r for r in self.rows if r.family == family)


@dataclass(frozen=True)
class StepInterval:
    """The interval of a predicted step time, or why there is none (``low``/``high`` None)."""

    predicted: float            # seconds, the plan's step time
    low: float | None           # seconds: what the fastest COVERAGE-central validation error implies
    high: float | None
    coverage: float
    basis: str                  # which residuals: "A100: 40 validation rows" / why none

    @property
    def known(self) -> bool:
        return self.low is not None

    def scale(self, value: float | None) -> tuple[float, float] | None:
        """The interval of a quantity proportional to the step time (time to train, GPU-hours, cost)."""
        if value is None or not self.known:
            return None
        return value * self.low / self.predicted, value * self.high / self.predicted


@dataclass(frozen=True)
class RatioInterval:
    """The interval of the measured ratio of two step times (B over A), from paired residuals."""

    predicted: float            # step time of B / step time of A
    low: float
    high: float
    coverage: float
    basis: str                  # which pairs, and what is assumed of the two errors

    @property
    def tie(self) -> bool:
        """Whether the interval holds 1: the difference is within the model's error."""
        return self.low <= 1.0 <= self.high


def residuals() -> Residuals:
    """The recorded residuals (:data:`RESIDUALS_PATH`, read once per path)."""
    return _load(RESIDUALS_PATH)


@functools.lru_cache(maxsize=None)
def _load(path: Path) -> Residuals:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanFormatError(f"cannot read the validation residuals {path}: {exc}; {REWRITE}") from exc
    if not isinstance(data, Mapping) or data.get("schema") != RESIDUALS_SCHEMA:
        raise PlanFormatError(f"{path} is not a residuals file of schema {RESIDUALS_SCHEMA}; {REWRITE}")
    try:
        rows = tuple(Residual(id=str(r["id"]), source=str(r["source"]), device=str(r["device"]),
                              family=str(r["family"]), sweep=r["sweep"], error=float(r["error"]))
                     for r in data["rows"])
        families = {str(k): str(v) for k, v in data["families"].items()}
        description = str(data["description"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlanFormatError(f"{path} is malformed ({exc!r}); {REWRITE}") from exc
    bad = [r.id for r in rows if not math.isfinite(r.error) or r.error <= -1]
    if not rows or bad:
        raise PlanFormatError(f"{path} holds no usable residuals (bad rows: {bad}); {REWRITE}")
    return Residuals(description=description, families=families, rows=rows)


def quantiles(values: Sequence[float], coverage: float = COVERAGE) -> tuple[float, float]:
    """The lower and upper bounds of the central ``coverage`` of ``values``: their (1 - coverage) / 2 and
    (1 + coverage) / 2 percentiles, interpolated linearly between order statistics (numpy.percentile's
    default)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        i = min(int(pos), len(ordered) - 2) if len(ordered) > 1 else 0
        if len(ordered) == 1:
            return ordered[0]
        return ordered[i] + (pos - i) * (ordered[i + 1] - ordered[i])

    return at((1 - coverage) / 2), at((1 + coverage) / 2)


def _rows_for(device: str, data: Residuals) -> tuple[tuple[Residual, ...], str] | str:
    """The residuals that price ``device`` and their label, or why none do."""
    family = data.families.get(device)
    if family is None:
        return (f"no published validation run covers {device!r}: the recorded errors are the GPU presets' on "
                "published GPU runs, which say nothing of a CPU's or a measured profile's")
    own = data.of_family(family)
    if len(own) >= MIN_ROWS:
        return own, f"{family}: {len(own)} published validation runs"
    families = ", ".join(sorted({r.family for r in data.rows}))
    own_rows = f"only {len(own)}" if own else "none"
    return data.rows, (f"all {len(data.rows)} published validation runs, {families}: {family} has {own_rows} "
                       f"of its own, under {MIN_ROWS}")


def step_interval(device: str, step_time: float, data: Residuals | None = None) -> StepInterval:
    """The ``COVERAGE`` interval of a step predicted at ``step_time`` seconds on the device named ``device``."""
    data = data or residuals()
    found = _rows_for(device, data)
    if isinstance(found, str):
        return StepInterval(step_time, None, None, COVERAGE, found)
    rows, basis = found
    e_lo, e_hi = quantiles([r.error for r in rows])
    return StepInterval(step_time, step_time / (1 + e_hi), step_time / (1 + e_lo), COVERAGE, basis)


def ratio_interval(device_a: str, time_a: float, device_b: str, time_b: float, *, same_model: bool,
                   data: Residuals | None = None) -> RatioInterval | None:
    """The ``COVERAGE`` interval of the measured ratio B / A of two predicted step times (module docstring),
    or None when either device has no residuals."""
    data = data or residuals()
    found_a, found_b = _rows_for(device_a, data), _rows_for(device_b, data)
    if isinstance(found_a, str) or isinstance(found_b, str):
        return None
    rows_a, rows_b = found_a[0], found_b[0]
    sweeps: dict[str, list[Residual]] = {}
    for r in data.rows:
        if r.sweep:
            sweeps.setdefault(r.sweep, []).append(r)
    sweeps = {k: rows for k, rows in sweeps.items() if len(rows) > 1}
    pairs = [(a, b) for rows in sweeps.values() for a in rows for b in rows if a is not b]
    if pairs and same_model and data.families[device_a] == data.families[device_b]:
        families = ", ".join(sorted({a.family for a, _ in pairs}))
        basis = (f"from {len(pairs)} ordered pairs of configurations measured in one validation sweep ({len(sweeps)} "
                 f"sweeps on {families}): one model on one device family, its two errors assumed as correlated "
                 "as within a sweep")
    else:
        pairs = [(a, b) for a in rows_a for b in rows_b if a is not b]
        basis = (f"from {len(pairs)} pairs of published validation runs (A's {found_a[1]}; B's {found_b[1]}): "
                 "different models or device families, their errors assumed independent")
    # measured B / A = predicted B / A x (1 + e_a) / (1 + e_b)
    lo, hi = quantiles([(1 + a.error) / (1 + b.error) for a, b in pairs])
    predicted = time_b / time_a
    return RatioInterval(predicted, predicted * lo, predicted * hi, COVERAGE, basis)
