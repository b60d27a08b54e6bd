"""Formatting at the edge: seconds, bytes and shares as text (code and JSON keep SI units)."""

from __future__ import annotations

from ..plan import Plan, Stage, StepInterval

GB = 1e9

BREAKDOWN_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "activation recomputation",
    "tp_comm": "tensor-parallel communication",
    "p2p": "pipeline send/receive",
    "bubble": "pipeline bubble",
    "dp_comm": "data-parallel communication (exposed)",
    "optimizer": "optimizer step",
    "cp_comm": "context-parallel ring (exposed)",
    "ep_comm": "expert-parallel all-to-all",
}
"""TimeBreakdown field -> what it is, for people."""

OPTIONAL_BREAKDOWN = ("cp_comm", "ep_comm")
"""Parts shown only when a plan has them (context / expert parallelism)."""

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers")


def seconds(value: float) -> str:
    """"12.3 s", "45.6 ms" or "789 us": three or four significant digits in the unit that fits."""
    a = abs(value)
    if a >= 1:
        return f"{value:.3g} s" if a < 100 else f"{value:.0f} s"
    if a >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    if a == 0:
        return "0"
    return f"{value * 1e6:.3g} us"


def quantity(value: float) -> str:
    """"13.28", "108.8k", "2.51M", "15T": four significant digits with a k / M / B (billion) / T suffix."""
    a = abs(value)
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if size <= a < 1e3 * size:
            return f"{value / size:.4g}{suffix}"
    return f"{value:.4g}"


def flops_rate(value: float) -> str:
    """"148.3 TFLOP/s", "52.61 GFLOP/s", "812 MFLOP/s": FLOP/s, four significant digits in the unit that
    fits (a CPU's hundreds of GFLOP/s are not "0.0 TFLOP/s")."""
    for size, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.4g} {prefix}FLOP/s"
    return f"{value:.4g} FLOP/s"


def heading(plan: Plan) -> str:
    """"autopar plan" for a searched plan, "autopar estimate" for one configuration's estimate."""
    return "autopar estimate" if plan.optimal is None else "autopar plan"


def throughput(plan: Plan) -> str:
    """"13.28 samples/s (108.8k tokens/s)": samples/s, and tokens/s for a sequence model
    (Plan.tokens_per_second: its sequence length from the recorded example inputs)."""
    text = f"{plan.throughput:.4g} samples/s"
    tokens = plan.tokens_per_second
    return text if tokens is None else f"{text} ({quantity(tokens)} tokens/s)"


def step_range(interval: StepInterval) -> str:
    """"8.8-11.2 s": an interval's bounds in the unit of its upper one; "-" when there is none."""
    if not interval.known:
        return "-"
    high = seconds(interval.high)
    unit = high.split()[-1]
    low = interval.low / {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
    return f"{low:.0f}-{high}" if low >= 100 else f"{low:.3g}-{high}"


def interval_line(interval: StepInterval) -> str:
    """"80% interval 8.8-11.2 s (A100: 40 validation rows)", or "no interval: <why>"."""
    if not interval.known:
        return f"no interval: {interval.basis}"
    return f"{interval.coverage:.0%} interval {step_range(interval)} ({interval.basis})"


def gigabytes(value: float) -> str:
    return f"{value / GB:.2f} GB"


def percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def layer_span(names: tuple[str, ...]) -> str:
    """"blocks.0 .. blocks.7 (8 layers)" for a run of layers; "-" for none."""
    if not names:
        return "-"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} layers)"


def stage_layers(plan: Plan, index: int) -> str:
    """A stage's layers, one span per model chunk (interleaved stages hold several)."""
    stage = plan.stages[index]
    return " | ".join(layer_span(c) for c in stage.chunks if c) or layer_span(stage.layers)


def cluster_spec(plan: Plan) -> str:
    """"128x8xA100-80GB": the cluster in Cluster.from_spec's words."""
    c = plan.cluster
    return f"{c.nodes}x{c.devices_per_node}x{c.device.name}"


def peak_stage(plan: Plan) -> Stage:
    """The pipeline stage whose device holds the most memory."""
    return max(plan.stages, key=lambda s: s.memory.total)
