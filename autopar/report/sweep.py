"""``Sweep.table()``: a model across cluster sizes as a text table, with what each column means."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .format import gigabytes, percent, quantity, seconds, step_range

if TYPE_CHECKING:
    from ..plan.sweep import Sweep, SweepRow

DAY = 86400.0


def duration(value: float) -> str:
    """"42.0 min", "17.5 h", "106 days": a span of training time in the unit people plan in."""
    if value < 3600:
        return seconds(value) if value < 60 else f"{value / 60:.3g} min"
    if value < 2 * DAY:
        return f"{value / 3600:.3g} h"
    return f"{value / DAY:.3g} days" if value < 1000 * DAY else f"{value / DAY:.0f} days"


def money(value: float) -> str:
    """"$10.2M", "$512k", "$950": three significant digits."""
    return "$" + quantity(float(f"{value:.3g}"))


def sweep_table(sweep: "Sweep") -> str:
    """A header, one line per size (a numbered reason for each size without a plan), and a footer defining
    the columns: MFU, tokens/s, time to train and cost."""
    columns = _columns(sweep)
    cells = [[fmt(r) if r.ok or name in ("nodes", "GPUs") else "-" for name, fmt in columns] for r in sweep.rows]
    reasons = []
    for r, line in zip(sweep.rows, cells):
        if not r.ok:
            reasons.append(f"({len(reasons) + 1}) {r.nodes} node{'s' if r.nodes > 1 else ''}: {r.error}")
            line[2] = f"no plan, see ({len(reasons)})"
    heads = [name for name, _ in columns]
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(heads)]

    def join(items: list[str]) -> str:      # the plan column left-aligned, numbers right-aligned
        return "  ".join(s.ljust(w) if i == 2 else s.rjust(w) for i, (s, w) in enumerate(zip(items, widths))).rstrip()

    notes = list(dict.fromkeys(p.loss.note for p in sweep.plans if p is not None and p.loss and p.loss.note))
    return "\n".join([_title(sweep), "  " + join(heads), *("  " + join(line) for line in cells), *reasons,
                      *(f"note: {n}" for n in notes), *_footer(sweep)])


def ranged(value: float, row: "SweepRow", fmt: Callable[[float], str]) -> str:
    """"17.5 h (15.6-19.9 h)": a quantity proportional to the step time, with its interval when there is one."""
    bounds = row.interval.scale(value)
    if bounds is None:
        return fmt(value)
    low, high = fmt(bounds[0]), fmt(bounds[1])
    if " " in low and low.split(" ", 1)[1] == high.split(" ", 1)[-1]:     # "1727-2194 days": the unit once
        low = low.split(" ", 1)[0]
    return f"{fmt(value)} ({low}-{high})"


def _columns(sweep: "Sweep") -> list[tuple[str, Callable[["SweepRow"], str]]]:
    def step(r: "SweepRow") -> str:
        interval = r.interval
        return seconds(r.step_time) if not interval.known else f"{seconds(r.step_time)} ({step_range(interval)})"

    columns: list[tuple[str, Callable[[SweepRow], str]]] = [
        ("nodes", lambda r: str(r.nodes)), ("GPUs", lambda r: str(r.gpus)),
        ("plan", lambda r: r.plan.config.short()), ("step", step)]
    if sweep.tokens_per_sample is None:
        columns.append(("samples/s", lambda r: f"{r.samples_per_second:.4g}"))
    else:
        columns.append(("tokens/s", lambda r: quantity(r.tokens_per_second)))
    columns += [("MFU", lambda r: percent(r.mfu)), ("mem/GPU", lambda r: gigabytes(r.peak_memory))]
    if sweep.tokens is not None:
        columns += [("time to train", lambda r: ranged(r.train_seconds, r, duration)),
                    ("GPU-hours", lambda r: ranged(r.gpu_hours, r, quantity))]
    if sweep.price_per_gpu_hour is not None:
        columns.append(("cost", lambda r: ranged(r.cost, r, money)))
    return columns


def _title(sweep: "Sweep") -> str:
    batch = f"global batch {sweep.global_batch_size}"
    if sweep.tokens_per_sample is not None:
        batch += (f" x {sweep.tokens_per_sample} tokens = "
                  f"{quantity(sweep.global_batch_size * sweep.tokens_per_sample)} tokens per step")
    train = "" if sweep.tokens is None else f"; training {quantity(sweep.tokens)} tokens"
    price = "" if sweep.price_per_gpu_hour is None else f" at ${sweep.price_per_gpu_hour:g} per GPU-hour"
    return (f"autopar sweep of {sweep.model_name} on nodes of {sweep.devices_per_node} x {sweep.device}: {batch}, "
            f"{sweep.precision}{train}{price}")


def _footer(sweep: "Sweep") -> list[str]:
    lines = [f"MFU = model FLOPs per step (forward + backward of the global batch, no recomputation) / (step time x "
             f"GPUs x {sweep.peak_flops / 1e12:g} TFLOP/s, the {sweep.device}'s dense {sweep.precision} peak)"]
    if sweep.tokens_per_sample is not None:
        text = f"tokens/s = {sweep.global_batch_size} x {sweep.tokens_per_sample} tokens per step / step time"
        if sweep.tokens is not None:
            text += f"; time to train = {quantity(sweep.tokens)} tokens / tokens/s; GPU-hours = GPUs x time to train"
        if sweep.price_per_gpu_hour is not None:
            text += f"; cost = GPU-hours x ${sweep.price_per_gpu_hour:g}"
        lines.append(text)
    lines.append("step = predicted seconds per optimizer step; mem/GPU = peak memory of the fullest device")
    lines += _interval_footer(sweep)
    return lines


def _interval_footer(sweep: "Sweep") -> list[str]:
    """What the ranges in brackets are, or why there are none (every row is on the same device)."""
    intervals = [r.interval for r in sweep.rows if r.ok]
    if not intervals:
        return []
    first = intervals[0]
    if not first.known:
        return [f"no ranges: {first.basis}"]
    ranged_columns = ["step"] + (["time to train", "GPU-hours"] if sweep.tokens is not None else [])
    ranged_columns += ["cost"] if sweep.price_per_gpu_hour is not None else []
    return [f"(a-b) = the {first.coverage:.0%} interval of {', '.join(ranged_columns)}: measured = predicted / "
            f"(1 + e), e the central {first.coverage:.0%} of autopar's step-time errors on published validation runs "
            f"({first.basis}; autopar/plan/residuals.json)"]
