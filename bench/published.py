"""Published training runs as autopar rows, read from bench/data/published_runs.json (the one dataset
of public step times; bench/sources.md and the file's `sources` cite each), split into calibration and
validation by bench/data/split.json.

Each row is the published model rebuilt on the meta device, the published cluster, and ``fixed=``
holding exactly what the source publishes (the row's ``config``); what it does not publish
(micro-batch size, interleaving, recomputation where not stated, ZeRO stage) is left to the planner,
as the authors tuned it; offloading, which a run that uses it states, is pinned off where the row does not. A row whose ``config`` holds every field is an estimate (``autopar.estimate``
prices the same). The prediction is the plan's step time, turned into the published metric with the
source's own FLOP formula (:meth:`Row.flops_per_step`).

ROWS are the calibration rows (bench/fidelity_published.py fits on them); :func:`load_rows` gives all.
Used by bench/fidelity_published.py, bench/fidelity_split.py and bench/plan_vs_megatron.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

import autopar
from autopar.capture import capture
from autopar.models import GPTConfig, LlamaConfig, build_gpt, build_llama
from autopar.config import DEFAULT_TIE_TOLERANCE
from autopar.solver import solve
from autopar.solver.choice import choose

DATA = Path(__file__).resolve().parent / "data"
RUNS = DATA / "published_runs.json"
SPLIT = DATA / "split.json"
# Meta's Grand Teton H100 (bench/sources.md section 8: 96 GB HBM2e at 2.4 TB/s, 500 W) is its own preset
# with its own constants: the power cap lowers what a GEMM sustains.
# presets.py: the H200 and the H800 have the H100 family's constants, the 500 W H100 its own
CONSTANT_FAMILIES = {"H100-96GB-500W": "H100-500W", "H200": "H100", "H800": "H100"}


@dataclass(frozen=True)
class Model:
    """A published model shape: "gpt" (Megatron GPT, learned positions, GELU MLP; ``attention`` "eager"
    as Megatron's 2019-2022 kernels, "sdpa" for a fused attention) or "llama" (RMSNorm, SwiGLU, RoPE,
    grouped-query attention)."""

    family: str
    hidden: int
    heads: int
    layers: int
    seq: int
    vocab: int
    kv_heads: int = 0
    ffn: int = 0
    attention: str = "eager"

    @property
    def params(self) -> float:
        """Parameter count, as the FLOP formulas take it (embeddings included, head untied)."""
        h, l, v = self.hidden, self.layers, self.vocab
        if self.family == "gpt":
            return 12 * l * h * h + 13 * l * h + v * h + self.seq * h + 2 * h
        kv = h // self.heads * self.kv_heads
        return l * (2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h) + 2 * v * h + h


@dataclass(frozen=True)
class Row:
    """One published run: what was trained where, with what, and the figure the source reports."""

    name: str
    source: str                    # key into the dataset's `sources`
    model: Model
    cluster: str                   # Cluster.from_spec string
    global_batch: int              # sequences per step
    fixed: Mapping[str, Any]       # exactly what the source publishes
    metric: str                    # "tflops" (per GPU) | "tokens" (per GPU per s) | "mfu" | "seconds" (per step)
    published: float
    flops: str | None = "megatron"  # FLOP formula of the source: "megatron" | "megatron-norecompute" | "palm"
    precision: autopar.Precision = autopar.Precision(compute="bf16", grads="fp32", kernels="fused")
    device: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # datasheet differences of the run's part
    # the source's network where it differs from the preset's: Link fields (bandwidth: the nominal NIC rate per
    # GPU per direction; efficiency: the achieved fraction, where the source measured its fabric)
    inter_node: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sweep: str | None = None       # rows of one model on one cluster at several configurations
    stack: str = ""

    @property
    def family(self) -> str:
        """The device family whose constants price this row (autopar/presets.py groups them)."""
        name = autopar.Cluster.from_spec(self.cluster).device.name
        return CONSTANT_FAMILIES.get(name, name.split("-")[0])

    def flops_per_step(self) -> float:
        m, b = self.model, self.global_batch
        if self.flops == "megatron":       # Narayanan et al. eq. (3): full recomputation counted
            return 96 * b * m.seq * m.layers * m.hidden ** 2 * (
                1 + m.seq / (6 * m.hidden) + m.vocab / (16 * m.layers * m.hidden))
        if self.flops == "megatron-norecompute":   # the same without the recomputed forward (model FLOPs)
            return 72 * b * m.seq * m.layers * m.hidden ** 2 * (
                1 + m.seq / (6 * m.hidden) + m.vocab / (12 * m.layers * m.hidden))
        # PaLM appendix B / torchtitan: 6 N per token plus 12 l h s for attention (not halved for causal)
        return b * m.seq * (6 * m.params + 12 * m.layers * m.hidden * m.seq)

    def metric_of(self, step_time: float, cluster: autopar.Cluster) -> float:
        """The published metric a step of ``step_time`` seconds would give."""
        if self.metric == "seconds":
            return step_time
        if self.metric == "tokens":
            return self.global_batch * self.model.seq / step_time / cluster.devices
        achieved = self.flops_per_step() / step_time / cluster.devices
        if self.metric == "mfu":
            return achieved / cluster.device.peak(self.precision.compute)
        return achieved / 1e12

    def step_time_of(self, value: float, cluster: autopar.Cluster) -> float:
        """The published step time the published metric implies (inverse of :meth:`metric_of`)."""
        return value if self.metric == "seconds" else self.metric_of(1.0, cluster) / value


def megatron_deepspeed_2022_fused_softmax(model: Model, tp: int, micro_batch: int) -> bool:
    """Whether the Megatron-DeepSpeed of 9f5f5d4c (2021-10-21) to 1cb76a64 (2022-03-06, "sync the whole Meg-LM
    fused_kernels sub-tree") ran its fused scale-mask-softmax for a causal GPT of ``model`` at this tensor
    parallelism and micro-batch (bigscience-workshop/Megatron-DeepSpeed megatron/model/fused_softmax.py @541b967f,
    ``is_kernel_available``); else it ran the PyTorch fallback (``Precision(fused_softmax=False)``).

    The check wants 16 < s <= 2048, s % 4 == 0 and ``b * np`` (micro-batch x heads per rank) a multiple of 4 and
    of the kernel's batches per block. It calls the static ``get_batch_per_block(b, np, sq, sk)`` as
    ``get_batch_per_block(sq, sk, b, np)``, which passes the CUDA helper (scaled_masked_softmax.h) the heads per
    rank as the key length: its block is then ``128 / min(2^ceil(log2 np), 32)`` warps of 2 rows, not the 4 rows of
    a 2048-long key. 64 heads at tp=8 (8 a rank): 32 rows, so micro-batches 1, 2 and 6 fall back, 4 and 8 do not;
    at tp=4 and tp=2 (16, 32 a rank): 16 and 8 rows, every micro-batch fused."""
    heads = model.heads // tp
    rows = micro_batch * heads
    if not (16 < model.seq <= 2048 and model.seq % 4 == 0 and rows % 4 == 0):
        return False
    key = 1 << max(0, math.ceil(math.log2(heads)))   # the CUDA helper's next power of two of the "key length"
    warp = min(key, 32)
    return rows % ((128 // warp) * (2 if key <= 128 else 1)) == 0


# Sources whose stack checked its fused softmax's constraints with code whose rule differs from the kernel's own
# (bench/sources.md): each row's precision says whether the fused kernel ran at its tp and micro-batch
FUSED_SOFTMAX_RULES = {"bloom-tr11-prequel": megatron_deepspeed_2022_fused_softmax}


# Sources whose fp16 runs used DeepSpeed 0.4.4-0.12's ZeRO stage 1 (its engine turns contiguous_gradients off at
# stage 1, so the optimizer all-reduces the gradients: runtime/engine.py, "meaningless in stage 1", and
# zero/stage_1_and_2.py reduce_ipg_grads -> buffered_reduce_fallback -> allreduce_bucket; bench/sources.md). The
# BLOOM prequel's bf16 rows (02-28 on) ran another optimizer (a BF16 branch, DeepSpeed's ZeRO stage 0): not these.
DEEPSPEED_STAGE1_ALL_REDUCE = frozenset({"bloom-tr11-prequel"})


def _precision(d: Mapping[str, Any], model: Model) -> autopar.Precision:
    precision = autopar.Precision(**d["precision"])
    config = d["config"]
    if d["source"] in DEEPSPEED_STAGE1_ALL_REDUCE and precision.compute == "fp16" and config.get("zero") == 1:
        precision = dataclasses.replace(precision, grad_reduce="all_reduce")
    rule = FUSED_SOFTMAX_RULES.get(d["source"])
    if rule is None or precision.kernels != "fused":
        return precision
    return dataclasses.replace(precision, fused_softmax=rule(model, config["tp"], config["micro_batch_size"]))


def _row(d: Mapping[str, Any]) -> Row:
    measured = d["measured"]
    model = Model(**d["model"])
    return Row(name=d["id"], source=d["source"], model=model, cluster=d["cluster"],
               global_batch=d["global_batch"], fixed=dict(d["config"]), metric=measured["metric"],
               published=measured["value"], flops=measured["flops"], precision=_precision(d, model),
               device=dict(d["device"]), inter_node=dict(d["inter_node"]), sweep=d["sweep"],
               stack=d["stack"])


@functools.lru_cache(maxsize=None)
def load_rows(path: Path = RUNS) -> tuple[Row, ...]:
    """Every row of the dataset, in file order."""
    return tuple(_row(d) for d in json.loads(Path(path).read_text())["rows"])


@functools.lru_cache(maxsize=None)
def load_split(path: Path = SPLIT) -> dict[str, str]:
    """Source key -> "calibration" | "validation", as bench/data/split.json fixed it."""
    split = json.loads(Path(path).read_text())
    out = {s: "calibration" for s in split["calibration"]} | {s: "validation" for s in split["validation"]}
    missing = {r.source for r in load_rows()} - set(out)
    if missing:
        raise SystemExit(f"bench/data/split.json assigns no split to the sources {sorted(missing)}: "
                         "a source added after the split was fixed joins validation (the file's rule)")
    return out


ROWS: list[Row] = [r for r in load_rows() if load_split()[r.source] == "calibration"]
TABLE1: list[Row] = [r for r in ROWS if r.source == "sc21-table1"]


@functools.lru_cache(maxsize=None)
def graph_of(model: Model):
    """The captured graph of ``model`` (meta device, bf16, batch 1), once per shape."""
    if model.family == "gpt":
        cfg = GPTConfig(vocab_size=model.vocab, hidden=model.hidden, heads=model.heads, layers=model.layers,
                        seq_len=model.seq, attention=model.attention)
        built, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    else:
        cfg = LlamaConfig(vocab_size=model.vocab, hidden=model.hidden, heads=model.heads, kv_heads=model.kv_heads,
                          layers=model.layers, ffn_hidden=model.ffn, seq_len=model.seq)
        built, inputs = build_llama(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(built, inputs)


def cluster_of(row: Row, **device: Any) -> autopar.Cluster:
    """The row's cluster; ``device`` overrides device constants (the fit scans matmul_efficiency)."""
    cluster = autopar.Cluster.from_spec(row.cluster)
    if row.inter_node:   # a field the source does not give (the achieved fraction, mostly) stays the preset's
        cluster = dataclasses.replace(cluster, inter_node=dataclasses.replace(cluster.inter_node, **row.inter_node))
    changes = {**row.device, **device}
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **changes)) if changes else cluster


# The pipeline schedules each stack runs (a row that does not publish its schedule is planned with these):
# Megatron-LM, Megatron-Core and Megatron-DeepSpeed run 1F1B and Megatron's interleaving (no zero-bubble
# schedule; DeepSpeed's own pipeline engine runs 1F1B); Megatron-LM in 2019 had no pipeline (1F1B is the
# schedule of one stage); the others are left to the planner.
STACK_SCHEDULES = {"Megatron-LM": ("1f1b", "interleaved"), "Megatron-Core": ("1f1b", "interleaved"),
                   "Megatron-DeepSpeed": ("1f1b", "interleaved"), "Megatron-LM (2019)": ("1f1b",)}


def plan_row(row: Row, **device: Any) -> autopar.Plan:
    """The planner's plan of ``row`` with everything published pinned, among the schedules its stack runs
    (:data:`STACK_SCHEDULES`: the planner's choice among the plans of each, as it chooses among candidates)."""
    graph, cluster = graph_of(row.model), cluster_of(row, **device)
    # a run that offloads states to host memory says so (DeepSpeed's ZeRO-Offload papers, Megatron's flags): one
    # that does not, did not
    fixed = {"offload": "none", **row.fixed}
    schedules = STACK_SCHEDULES.get(row.stack) if "schedule" not in row.fixed else None
    if schedules is None:
        return solve(graph, cluster, row.global_batch, precision=row.precision, fixed=fixed)[0]
    plans = []
    for schedule in schedules:
        try:
            plans.append(solve(graph, cluster, row.global_batch, precision=row.precision,
                               fixed={**fixed, "schedule": schedule})[0])
        except (autopar.InfeasiblePlanError, autopar.ConfigError):   # e.g. interleaving with pp pinned to 1
            continue
    if not plans:
        raise autopar.InfeasiblePlanError(f"{row.name}: no plan fits with any of {row.stack}'s schedules {schedules}")
    return choose(plans, DEFAULT_TIE_TOLERANCE)
