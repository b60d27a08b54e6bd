"""A sweep's record: the same model planned on several cluster sizes (autopar/sweep.py makes it).

:class:`Sweep` holds one :class:`SweepRow` per size (its plan, or the solver's message where nothing
fits, and the numbers read from the plan); ``table`` and ``plot`` are one-line facades on
autopar/report and autopar/viz, as Plan's are.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import ConfigError
from .interval import StepInterval
from .record import Plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CSV_COLUMNS = ("nodes", "gpus", "config", "step_time_s", "samples_per_s", "tokens_per_s", "mfu",
               "peak_memory_bytes", "train_s", "gpu_hours", "cost",
               "step_time_low_s", "step_time_high_s", "train_low_s", "train_high_s", "gpu_hours_low", "gpu_hours_high",
               "cost_low", "cost_high", "interval", "error")
"""The columns of :meth:`Sweep.to_csv` (and the keys of each row of :meth:`Sweep.to_dict`), SI units. The
``_low`` / ``_high`` ones bound the 80% interval of each predicted quantity (the plan's
:meth:`Plan.step_time_interval`, all of them proportional to the step time); ``interval`` says which
validation rows gave it, or why there is none (then the bounds are empty)."""


@dataclass(frozen=True)
class SweepRow:
    """One cluster size: its plan, or why there is none, and the numbers read from the plan.

    Every number is None when there is no plan; ``tokens_per_second`` when the model has no tokens
    per sample; ``train_seconds`` and ``gpu_hours`` when the sweep has no training tokens; ``cost``
    when it has no price."""

    nodes: int
    gpus: int
    plan: Plan | None
    error: str | None = None                 # why there is no plan (the solver's message)
    step_time: float | None = None           # seconds per optimizer step
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None                 # model FLOPs utilisation, a fraction
    peak_memory: float | None = None         # bytes, the fullest device
    train_seconds: float | None = None       # time to train the sweep's tokens
    gpu_hours: float | None = None
    cost: float | None = None                # gpu_hours x price per GPU-hour

    def __post_init__(self) -> None:
        if (self.plan is None) == (self.error is None):
            raise ConfigError(f"SweepRow of {self.nodes} node(s) needs a plan or an error, not "
                              f"{'both' if self.plan is not None else 'neither'}")

    @property
    def ok(self) -> bool:
        """Whether this size has a plan."""
        return self.plan is not None

    @property
    def interval(self) -> StepInterval | None:
        """The plan's step-time interval (None without a plan); :meth:`StepInterval.scale` bounds the time
        to train, GPU-hours and cost, which are proportional to the step time."""
        return None if self.plan is None else self.plan.step_time_interval()

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-native values, keyed by :data:`CSV_COLUMNS` (SI units)."""
        config = None if self.plan is None else self.plan.config.short()
        out = {"nodes": self.nodes, "gpus": self.gpus, "config": config,
               "step_time_s": self.step_time, "samples_per_s": self.samples_per_second,
               "tokens_per_s": self.tokens_per_second, "mfu": self.mfu, "peak_memory_bytes": self.peak_memory,
               "train_s": self.train_seconds, "gpu_hours": self.gpu_hours, "cost": self.cost}
        interval = self.interval
        for key, value in (("step_time", self.step_time), ("train", self.train_seconds),
                           ("gpu_hours", self.gpu_hours), ("cost", self.cost)):
            bounds = None if interval is None else interval.scale(value)
            unit = "_s" if key in ("step_time", "train") else ""
            out[f"{key}_low{unit}"], out[f"{key}_high{unit}"] = bounds or (None, None)
        if interval is not None:
            out["interval"] = (f"{interval.coverage:.0%} interval from {interval.basis}" if interval.known
                               else f"none: {interval.basis}")
        else:
            out["interval"] = None
        out["error"] = self.error
        return out


@dataclass(frozen=True, repr=False)
class Sweep:
    """The same model planned on several cluster sizes (:func:`sweep`), smallest first.

    ``print()`` it (or :meth:`table`) for the text table, :meth:`to_dict` / :meth:`to_csv` to
    export it, :meth:`plot` for the chart; ``rows`` hold the plans."""

    model_name: str
    device: str                          # the device's name, e.g. "H100-SXM"
    devices_per_node: int
    precision: str                       # the compute dtype the plans use (its peak defines MFU)
    peak_flops: float                    # FLOP/s per device at that dtype
    global_batch_size: int               # samples per step, the same on every size
    tokens_per_sample: int | None        # the sequence length (None: not a sequence model)
    tokens: float | None                 # training tokens priced (None: no time to train)
    price_per_gpu_hour: float | None     # None: no cost
    rows: tuple[SweepRow, ...]

    @property
    def plans(self) -> tuple[Plan | None, ...]:
        """Each row's plan (None where nothing fits)."""
        return tuple(r.plan for r in self.rows)

    def row(self, nodes: int) -> SweepRow:
        """The row of ``nodes`` nodes."""
        for r in self.rows:
            if r.nodes == nodes:
                return r
        raise ConfigError(f"the sweep has no row of {nodes} node(s); it has {[r.nodes for r in self.rows]}")

    def __iter__(self) -> Iterator[SweepRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    # --- reading and exporting it -----------------------------------------------------------------
    def table(self) -> str:
        """The text table: one row per size, reasons for the sizes without a plan, definitions."""
        from ..report.sweep import sweep_table
        return sweep_table(self)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        sizes = ",".join(str(r.nodes) for r in self.rows)
        return (f"<autopar.Sweep of {self.model_name} on {sizes} x {self.devices_per_node} x {self.device}, "
                f"global batch {self.global_batch_size}: print() it for the table>")

    def _repr_html_(self) -> str:
        import html
        return f"<pre>{html.escape(self.table())}</pre>"

    def to_dict(self, plans: bool = False) -> dict[str, Any]:
        """The sweep as JSON-native values (SI units); each row's whole plan too with ``plans=True``."""
        rows = []
        for r in self.rows:
            row = r.to_dict()
            if plans:
                row["plan"] = None if r.plan is None else r.plan.to_dict()
            rows.append(row)
        return {"model": self.model_name, "device": self.device, "devices_per_node": self.devices_per_node,
                "precision": self.precision, "peak_flops": self.peak_flops,
                "global_batch_size": self.global_batch_size, "tokens_per_sample": self.tokens_per_sample,
                "tokens": self.tokens, "price_per_gpu_hour": self.price_per_gpu_hour, "rows": rows}

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """One line per size with :data:`CSV_COLUMNS` (SI units; empty cells where a number is None);
        also written to ``path`` when given."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for r in self.rows:
            writer.writerow({k: "" if v is None else v for k, v in r.to_dict().items()})
        text = buffer.getvalue()
        if path is not None:
            with open(path, "w", newline="") as fh:
                fh.write(text)
        return text

    def plot(self, path: str | os.PathLike | None = None) -> "Figure":
        """Throughput, MFU and time to train (with its cost) against GPUs; a PNG at ``path`` if given."""
        from ..viz.sweep import plot_sweep
        return plot_sweep(self, path)
