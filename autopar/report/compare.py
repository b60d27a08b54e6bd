"""``Plan.compare(other)``: two plans side by side, the differences marked."""

from __future__ import annotations

import html
from dataclasses import dataclass, fields

from ..config import ParallelConfig
from ..plan import Plan, TimeBreakdown
from ..plan.interval import ratio_interval
from .format import (BREAKDOWN_LABELS, MEMORY_KINDS, cluster_spec, flops_rate, gigabytes, peak_stage, percent, quantity,
                     seconds, step_range)

RELATIVE_TOLERANCE = 0.005
"""Numbers closer than this (relative) count as equal in the table. Whether A or B is faster is judged
against the model's recorded error instead (plan/interval.py's ratio_interval), or by this where no
validation run covers a device."""


@dataclass(frozen=True)
class Row:
    """One line of a comparison: a quantity in plan A and in plan B."""

    label: str
    a: str
    b: str
    differs: bool
    change: str = ""      # "+12.3%" from A to B (numbers), "" otherwise


@dataclass(frozen=True)
class PlanComparison:
    """Plans A and B side by side; ``str()`` is a text table (differing rows marked ``*``),
    ``_repr_html_`` a notebook table (differing rows highlighted)."""

    title_a: str
    title_b: str
    rows: tuple[Row, ...]
    verdict: str
    warnings: tuple[str, ...] = ()

    @property
    def differences(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.differs)

    def __str__(self) -> str:
        width = max(len(r.label) for r in self.rows)
        wa = max(len(r.a) for r in self.rows + (Row("", "A", "B", False),))
        wb = max(len(r.b) for r in self.rows + (Row("", "A", "B", False),))
        lines = [f"A: {self.title_a}", f"B: {self.title_b}", *[f"warning: {w}" for w in self.warnings],
                 f"  {'':<{width}}  {'A':>{wa}}  {'B':>{wb}}  B vs A"]
        for r in self.rows:
            mark = "*" if r.differs else " "
            lines.append(f"{mark} {r.label:<{width}}  {r.a:>{wa}}  {r.b:>{wb}}  {r.change}".rstrip())
        lines.append(self.verdict)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        e = html.escape
        head = (f"<p><b>A</b>: {e(self.title_a)}<br><b>B</b>: {e(self.title_b)}</p>"
                + "".join(f"<p style='color:#b00'>warning: {e(w)}</p>" for w in self.warnings))
        body = "".join(
            f"<tr style='{'background:#fff3b0;font-weight:bold' if r.differs else ''}'><td style='text-align:left'>"
            f"{e(r.label)}</td><td>{e(r.a)}</td><td>{e(r.b)}</td><td>{e(r.change)}</td></tr>" for r in self.rows)
        return (f"{head}<table><thead><tr><th></th><th>A</th><th>B</th><th>B vs A</th></tr></thead>"
                f"<tbody>{body}</tbody></table><p>{e(self.verdict)}</p>")


def compare(a: Plan, b: Plan) -> PlanComparison:
    """Plan ``a`` against plan ``b``: configuration, step time and its parts, memory, efficiency."""
    rows = _setting_rows(a, b) + _config_rows(a.config, b.config) + _number_rows(a, b)
    return PlanComparison(title_a=_title(a), title_b=_title(b), rows=tuple(rows), verdict=_verdict(a, b),
                          warnings=_warnings(a, b))


def config_changes(a: ParallelConfig, b: ParallelConfig) -> str:
    """"tp 8 -> 4, pp 8 -> 16": the fields where ``b`` differs from ``a``."""
    changes = [f"{f.name} {_value(getattr(a, f.name))} -> {_value(getattr(b, f.name))}"
               for f in fields(ParallelConfig) if getattr(a, f.name) != getattr(b, f.name)]
    return ", ".join(changes) or "same configuration"


def _title(plan: Plan) -> str:
    kind = "estimate" if plan.optimal is None else "plan"
    return f"{kind} of {plan.model_name} on {cluster_spec(plan)}: {plan.config.short()}"


def _value(v) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or "-"
    return str(v)


def _text_row(label: str, a, b) -> Row:
    return Row(label, _value(a), _value(b), a != b)


def _number_row(label: str, a: float, b: float, fmt) -> Row:
    scale = max(abs(a), abs(b))
    differs = scale > 0 and abs(b - a) > RELATIVE_TOLERANCE * scale
    if a:
        change = f"{(b / a - 1) * 100:+.1f}%"
    else:
        change = "new" if b else ""
    return Row(label, fmt(a), fmt(b), differs, change if differs else "")


def _setting_rows(a: Plan, b: Plan) -> list[Row]:
    return [_text_row("model", a.model_name, b.model_name),
            _text_row("cluster", cluster_spec(a), cluster_spec(b)),
            _text_row("global batch", a.global_batch_size, b.global_batch_size),
            _text_row("precision", a.precision.compute, b.precision.compute),
            _text_row("kernels", a.precision.kernels_name, b.precision.kernels_name)]


def _config_rows(a: ParallelConfig, b: ParallelConfig) -> list[Row]:
    return [_text_row(f.name, getattr(a, f.name), getattr(b, f.name)) for f in fields(ParallelConfig)]


def _number_rows(a: Plan, b: Plan) -> list[Row]:
    rows = [_text_row("micro-batches per pipeline", a.micro_batches, b.micro_batches),
            _number_row("step time", a.step_time, b.step_time, seconds),
            _text_row(f"  {a.step_time_interval().coverage:.0%} interval", step_range(a.step_time_interval()),
                      step_range(b.step_time_interval())),
            _number_row("throughput (samples/s)", a.throughput, b.throughput, lambda v: f"{v:.4g}"),
            *_tokens_rows(a, b),
            _number_row("MFU", a.mfu, b.mfu, percent),
            _number_row("FLOP/s per device", a.tflops_per_device * 1e12, b.tflops_per_device * 1e12, flops_rate)]
    rows += [_number_row(f"  {BREAKDOWN_LABELS[k]}", getattr(a.breakdown, k), getattr(b.breakdown, k), seconds)
             for k in TimeBreakdown.__annotations__]
    rows.append(_number_row("peak memory per device", a.peak_memory, b.peak_memory, gigabytes))
    pa, pb = peak_stage(a), peak_stage(b)
    rows += [_number_row(f"  {kind} (fullest stage)", getattr(pa.memory, kind), getattr(pb.memory, kind), gigabytes)
             for kind in MEMORY_KINDS]
    rows.append(_text_row("fits in device memory", a.fits, b.fits))
    return rows


def _tokens_rows(a: Plan, b: Plan) -> list[Row]:
    """Tokens/s when both plans are of sequence models (Plan.tokens_per_second), else none."""
    ta, tb = a.tokens_per_second, b.tokens_per_second
    if ta is None or tb is None:
        return []
    return [_number_row("throughput (tokens/s)", ta, tb, quantity)]


def _verdict(a: Plan, b: Plan) -> str:
    memory = b.peak_memory - a.peak_memory
    lean = f"; B needs {gigabytes(abs(memory))} {'more' if memory > 0 else 'less'} peak memory per device than A"
    if a.fits != b.fits:
        return f"only {'A' if a.fits else 'B'} fits in device memory" + lean
    speed = a.step_time / b.step_time - 1
    faster = "B" if speed > 0 else "A"
    ratio = abs(speed) if speed > 0 else b.step_time / a.step_time - 1
    if abs(speed) <= RELATIVE_TOLERANCE:
        return "A and B take the same time per step (within 0.5%)" + lean
    claim = f"{faster} is faster: {ratio * 100:.1f}% more throughput"
    error = ratio_interval(a.cluster.device.name, a.step_time, b.cluster.device.name, b.step_time,
                           same_model=a.fingerprint == b.fingerprint)
    if error is None:
        why = next(iv.basis for iv in (a.step_time_interval(), b.step_time_interval()) if not iv.known)
        return claim + lean + f"; no error bar: {why}"
    judged = (f"the measured step ratio B / A would be {error.low:.3f}-{error.high:.3f} ({error.coverage:.0%} "
              f"interval; predicted {error.predicted:.3f}) {error.basis}")
    if error.tie:
        return (f"A and B tie: {faster} is predicted {ratio * 100:.1f}% faster, within the model's error: {judged}"
                + lean)
    return f"{claim}, beyond the model's error: {judged}" + lean


def _warnings(a: Plan, b: Plan) -> tuple[str, ...]:
    out = []
    if a.fingerprint != b.fingerprint:
        out.append("the plans are for different models (fingerprints differ): the comparison is of apples and pears")
    if a.global_batch_size != b.global_batch_size:
        out.append("the global batches differ: compare throughput, not step time")
    return tuple(out)
