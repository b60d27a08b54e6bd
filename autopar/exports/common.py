"""What every exporter shares: the traced field, the export result, and the facts of a plan that the
stacks ask for in their own terms (sequence length, the transformer blocks, the pipeline partition in
chunk order, one recompute mode, the memory a stack's fallback adds).

A :class:`Field` is one value an exporter writes: the stack's key, the value, the plan fields it came
from (``sources``, paths into ``Plan.to_dict()`` such as ``config.tp`` or ``stages[].chunks``; empty
only for a constant of the stack's format, such as accelerate's ``compute_environment``) and the
stack's documentation of the key. Exporters build their text from their fields, so the file and the
trace cannot disagree; what a stack cannot express goes into ``warnings`` and into the file's comments.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from ..files import write_atomic

if TYPE_CHECKING:
    from ..plan import Plan

# How much each recompute mode recomputes (and so how little it keeps): a stack that has one mode for
# the whole model gets the plan's most recomputing one, which keeps no more activations than any stage.
RECOMPUTE_ORDER = {"none": 0, "selective": 1, "op": 2, "full": 3}   # by what each keeps, most first
RECOMPUTE_PART = {"selective": "attention's core", "op": "per op: every other matmul output and attention's kept"}
"""What the partial recompute modes recompute, for warnings about stacks that lack them."""
COMMENT_WIDTH = 100


@dataclass(frozen=True)
class Field:
    """One exported value, traced to the plan fields it came from and the stack's documentation."""

    key: str                    # the stack's name: "parallelism.tensor_parallel_degree", "--micro-batch-size"
    value: Any                  # JSON-native (int, str, bool, list); True for a flag without a value
    sources: tuple[str, ...]    # paths into Plan.to_dict(); () only for a constant of the stack's format
    doc: str                    # where the stack documents the key (page or source file and name)
    note: str = ""              # how the value follows from the sources when it is not a copy

    def comment(self) -> str:
        """The file comment naming where the value came from."""
        origin = ", ".join(self.sources) if self.sources else "fixed by the format"
        return f"{origin}{': ' + self.note if self.note else ''}"


class Fields(list):
    """The fields an exporter writes, in the order its file lists them."""

    def add(self, key: str, value: Any, sources: tuple[str, ...], doc: str, note: str = "") -> None:
        self.append(Field(key, value, sources, doc, note))


@dataclass(frozen=True)
class Export:
    """A plan written for one training stack: its file's text, each field traced, and what the stack
    cannot express (also in the text, as comments, where the format has comments)."""

    stack: str
    text: str
    fields: tuple[Field, ...]
    warnings: tuple[str, ...]
    filename: str               # a name for the file when the caller gives none

    def field(self, key: str) -> Field:
        """The field written under ``key``; KeyError naming the keys there are when none."""
        for f in self.fields:
            if f.key == key:
                return f
        raise KeyError(f"{self.stack} export has no field {key!r}; it has {[f.key for f in self.fields]}")

    def write(self, path: str | os.PathLike) -> str:
        """Write the text atomically (a temporary file in the same folder, then a rename); the path."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return write_atomic(path, self.text)


def comment_block(lines: Sequence[str], prefix: str = "# ") -> list[str]:
    """``lines`` as comment lines wrapped at COMMENT_WIDTH, continuation lines indented."""
    out: list[str] = []
    for line in lines:
        wrapped = textwrap.wrap(line, COMMENT_WIDTH - len(prefix), subsequent_indent="  ",
                                break_long_words=False, break_on_hyphens=False) or [""]
        out.extend(prefix + w for w in wrapped)
    return out


def header(plan: "Plan", stack: str, warnings: Sequence[str], prefix: str = "# ") -> list[str]:
    """The comment lines that open an exported file: what it is, from which plan, and what is lost."""
    lines = [f"{stack} configuration written by `autopar export --to {_stack_arg(stack)}` from the plan of "
             f"{plan.model_name} on {plan.cluster.nodes} x {plan.cluster.devices_per_node} x "
             f"{plan.cluster.device.name}: {plan.config.short()}, global batch {plan.global_batch_size}.",
             "Each value's comment names the plan field it came from (docs/plan-format.md)."]
    if warnings:
        lines.append(f"What {stack} cannot express of the plan ({len(warnings)}):")
        lines.extend(f"- {w}" for w in warnings)
    else:
        lines.append(f"{stack} expresses every field of the plan that it reads.")
    return comment_block(lines, prefix)


def _stack_arg(stack: str) -> str:
    return {"Megatron-LM": "megatron", "DeepSpeed": "deepspeed"}.get(stack, stack.lower())


# --- facts of a plan ----------------------------------------------------------------------------------
def seq_len(plan: "Plan") -> tuple[int | None, str]:
    """The sequence length of the plan's example inputs (dim 1 of the first token input) and the plan
    field it is read from; (None, reason) when the plan does not record a [batch, seq] input."""
    inputs = plan.extra.get("inputs")
    if not isinstance(inputs, dict):
        return None, "the plan records no example inputs (extra.inputs)"
    if inputs.get("kind") == "kwargs":
        entries = [(f"extra.inputs.kwargs.{name}", v) for name, v in (inputs.get("kwargs") or {}).items()]
        entries.sort(key=lambda e: e[0] != "extra.inputs.kwargs.input_ids")   # input_ids first, if there
    else:
        entries = [(f"extra.inputs.args[{i}]", v) for i, v in enumerate(inputs.get("args") or [])]
    for path, entry in entries:
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if isinstance(shape, list) and len(shape) >= 2 and isinstance(shape[1], int):
            return shape[1], f"{path}.shape[1]"
    return None, "the plan's example inputs have no [batch, sequence] tensor (extra.inputs)"


@dataclass(frozen=True)
class Layers:
    """The plan's layers by role: the repeated transformer blocks, what comes before the first
    (embeddings), after the last (final norm, head), and between them (a layer no stack places)."""

    names: tuple[str, ...]
    blocks: tuple[str, ...]
    pre: tuple[str, ...]
    post: tuple[str, ...]
    between: tuple[str, ...]
    norms: frozenset[str]       # of ``post``, the layers without a matmul or loss (the final norm)
    source: str                 # the plan field the roles are read from

    def role(self, name: str) -> str:
        return ("block" if name in self._block_index else "pre" if name in self.pre
                else "post" if name in self.post else "between")

    def block_index(self, name: str) -> int:
        return self._block_index[name]

    @cached_property
    def _block_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.blocks)}


def layers_of(plan: "Plan") -> Layers:
    """The roles of the plan's layers: from ``structure`` (layers sharing a body at least twice are the
    repeated blocks; after them, a layer without a matmul or loss is a norm, the others the output
    head), or for a plan without one (schema 1) from the names (``prefix.N`` blocks, ``*norm*``)."""
    ordered = tuple(name for chunk in chunks_in_order(plan) for name in chunk)
    if plan.structure is not None:
        counts: dict[int, int] = {}
        for _, body in plan.structure.layers:
            counts[body] = counts.get(body, 0) + 1
        body_of = dict(plan.structure.layers)
        is_block = {name: counts[body_of[name]] >= 2 for name in body_of}
        heads = {name for name, body in plan.structure.layers
                 if any(a.kind in ("matmul", "loss") for a in plan.structure.bodies[body])}
        order = tuple(name for name, _ in plan.structure.layers)
        source = "structure.layers"
    else:
        numbered = [re.match(r"^(.*)\.(\d+)$", n) for n in ordered]
        prefixes = [m.group(1) for m in numbered if m]
        common = max(set(prefixes), key=prefixes.count) if prefixes else None
        is_block = {n: bool(m) and m.group(1) == common for n, m in zip(ordered, numbered)}
        heads = {n for n in ordered if "norm" not in n.rsplit(".", 1)[-1]}
        order = ordered
        source = "stages[].layers"
    first = next((i for i, n in enumerate(order) if is_block[n]), len(order))
    last = max((i for i, n in enumerate(order) if is_block[n]), default=-1)
    post = order[last + 1:]
    return Layers(names=order, blocks=tuple(n for n in order if is_block[n]), pre=order[:first], post=post,
                  between=tuple(n for n in order[first:last + 1] if not is_block[n]),
                  norms=frozenset(n for n in post if n not in heads), source=source)


def chunks_in_order(plan: "Plan") -> list[tuple[str, ...]]:
    """The model chunks in model order (Plan.model_chunks: looped, or ZB-V's V as torch's "v" style places them)."""
    return plan.model_chunks()


def zero_bubble_substitute(plan: "Plan", stack: str, written: str) -> str:
    """What an export says of a zero-bubble schedule its stack cannot run: what it writes instead."""
    cfg = plan.config
    share = plan.breakdown.bubble / plan.step_time if plan.step_time > 0 else 0.0
    return (f"config.schedule = {cfg.schedule!r} (zero bubble: backwards split into input- and weight-gradient "
            f"passes, the weight passes filling the bubble, {share:.1%} of the predicted step): {stack} has no such "
            f"schedule; written as {written}, whose bubble is larger (price it with schedule={written.split()[0]!r} "
            "to see by how much)")


def recompute_mode(plan: "Plan", stack: str) -> tuple[str, list[str]]:
    """One recompute mode for a stack that has one for the whole model, and what that loses: the plan's
    mode, or with per-stage modes the one that recomputes most (keeping no more activations on any
    stage than the plan does, at the price of recomputing on stages the plan did not)."""
    cfg = plan.config
    if not cfg.stage_recompute:
        return cfg.recompute, []
    modes = sorted(set(cfg.stage_recompute), key=RECOMPUTE_ORDER.__getitem__)
    if len(modes) == 1:
        return modes[0], []
    chosen = modes[-1]
    return chosen, [f"per-stage recomputation (config.stage_recompute = [{', '.join(cfg.stage_recompute)}]): "
                    f"{stack} has one mode for every stage; written as {chosen!r} everywhere, which keeps no "
                    f"more activations than the plan on any stage and recomputes more on the stages the plan "
                    f"left at {', '.join(repr(m) for m in modes[:-1])}"]


def unsharded_memory(plan: "Plan", zero: int) -> tuple[float, bool]:
    """The peak bytes per device if the plan's ZeRO stage falls back to ``zero`` (lower): the gradients
    (below stage 2) and parameters (below stage 3) held whole instead of sharded, per stage from its
    parameter count; and whether that still fits the device."""
    prec = plan.precision
    peak = 0.0
    for stage in plan.stages:
        mem = stage.memory
        grads = mem.grads if zero >= 2 else max(mem.grads, stage.param_count * prec.grad_bytes)
        params = mem.params if zero >= 3 else max(mem.params, stage.param_count * prec.weight_bytes)
        peak = max(peak, params + grads + mem.optimizer + mem.activations + mem.buffers)
    return peak, peak <= plan.cluster.device.memory


def optimizer_on_device(plan: "Plan", sharded: bool) -> tuple[float, bool]:
    """The peak bytes per device if the optimizer states that ``offload = "optimizer"`` keeps in host memory
    stay on the device (a stack without optimizer-only offload): the fp32 master weights under mixed
    precision and the optimizer's own states, ZeRO-sharded over the data-parallel ranks (``sharded``) or
    whole, per stage from its parameter count; and whether that still fits the device."""
    cfg, prec = plan.config, plan.precision
    peak = 0.0
    for stage in plan.stages:
        mem = stage.memory
        params = cfg.zero_shard(stage.param_count, stage.expert_param_count) if sharded else stage.param_count
        optimizer = max(mem.optimizer, params * prec.optimizer_bytes)
        peak = max(peak, mem.params + mem.grads + optimizer + mem.activations + mem.buffers)
    return peak, peak <= plan.cluster.device.memory


def zero1_for_offload(ranks: int) -> str:
    """What writing ZeRO-1 for a ZeRO-0 plan that offloads its optimizer (a stack that offloads only under
    ZeRO-1 or its distributed optimizer) changes, over ``ranks`` data-parallel ranks, in words."""
    if ranks == 1:
        return "with one data-parallel rank the same as the plan's ZeRO-0"
    return (f"which shards the optimizer states, their host copies and the CPU step over the {ranks} data-parallel "
            "ranks: less host memory and CPU work than the plan, the same bytes on the network")


def peak_instead(plan: "Plan", peak: float, fits: bool) -> str:
    """What a stack's fallback does to the peak memory per device, in words: the new peak against the plan's
    and the device's, or that the plan already counts it."""
    if peak <= max(stage.memory.total for stage in plan.stages) * (1 + 1e-6):
        return f"within the plan's {gb(plan.peak_memory)} per device"
    return (f"about {gb(peak)} per device at the peak instead of {gb(plan.peak_memory)}, which "
            f"{'still fits' if fits else 'does not fit'} the {gb(plan.cluster.device.memory)} device")


def base_warnings(plan: "Plan") -> list[str]:
    """What every export says first: a plan that does not fit its devices."""
    if plan.fits:
        return []
    return [f"the plan does not fit: {gb(plan.peak_memory)} per device at the peak, over the "
            f"{gb(plan.cluster.device.memory)} device (fits = false); this configuration would run out of memory"]


def accumulated_by_autograd(plan: "Plan", stack: str) -> list[str]:
    """The warning of an export to a stack that adds micro-batches' gradients by autograd (torchtitan, DeepSpeed,
    accelerate) of a plan priced with fused accumulation (Precision.grad_accumulation "fused")."""
    if plan.precision.grad_accumulation != "fused" or plan.micro_batches <= 1:
        return []
    return [f"precision.grad_accumulation = 'fused' (Megatron-LM's gradient-accumulation fusion): {stack} adds each of "
            f"the {plan.micro_batches} micro-batches' gradients by autograd, a pass over the gradients per micro-batch "
            "the plan did not price: slower than predicted (re-plan with Precision(grad_accumulation='autograd'))"]


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"
