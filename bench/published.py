"""Published training runs as autopar rows: every public step-time row of
bench/sources.md (sections 1, 2 and 8), rebuilt and planned the way a user would.

Each row is the published model rebuilt on the meta device, the published cluster, and
``fixed=`` holding exactly what the source publishes (tensor / pipeline / context / data
parallel degrees, and whatever else it states); what it does not publish (micro-batch size,
interleaving, recomputation where not stated, ZeRO stage) is left to the planner, as the
authors tuned it. The prediction is the plan's step time, turned into the published metric
with the source's own FLOP formula (:func:`megatron_flops`, :func:`palm_flops`).

Used by bench/fidelity_published.py (fit, leave-one-out, report) and bench/plan_vs_megatron.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch

import autopar
from autopar.capture import capture
from autopar.models import GPTConfig, LlamaConfig, build_gpt, build_llama
from autopar.solver import solve

MEGATRON_VOCAB = 51200
LLAMA3_VOCAB = 128256
# Megatron-LM trains with bf16 (fp16 on V100) weights, fp32 main gradients and fp32 Adam: 18 bytes
# of model state per parameter (Narayanan et al. section 5; Shoeybi et al. section 5), with its
# hand-fused kernels (layer norm, bias + GeLU, scaled masked softmax; Narayanan et al. section 4.2),
# which keep the activations Korthikanti et al. count: kernels="fused".
MEGATRON_BF16 = autopar.Precision(compute="bf16", grads="fp32", kernels="fused")
# Megatron-LM 2019 (the V100 rows) all-reduced fp16 gradients: its `--fp32-allreduce` flag, off by
# default, was what reduced them in fp32 (megatron/arguments.py of that release).
MEGATRON_2019_FP16 = autopar.Precision(compute="fp16", grads="fp16", kernels="fused")
# Llama 3: bf16 compute with fp32 gradient reduction, fp32 master weights and Adam, on Meta's
# production stack, whose kernels are not published: assumed to keep no more for backward than a
# compiled program's minimum cut (kernels="compiled"), the leanest the planner knows.
LLAMA_BF16 = autopar.Precision(compute="bf16", grads="fp32", kernels="compiled")
# torchtitan: FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32); its "eager"
# column runs PyTorch eager kernels, its "torch.compile" column compiles each transformer block.
TITAN_EAGER = autopar.Precision(compute="bf16", grads="fp32", kernels="eager")
TITAN_COMPILED = autopar.Precision(compute="bf16", grads="fp32", kernels="compiled")


@dataclass(frozen=True)
class Model:
    """A published model shape: "gpt" (Megatron GPT, learned positions, GELU MLP, eager attention
    as Megatron's 2019-2021 kernels) or "llama" (RMSNorm, SwiGLU, RoPE, grouped-query attention)."""

    family: str
    hidden: int
    heads: int
    layers: int
    seq: int
    vocab: int
    kv_heads: int = 0
    ffn: int = 0

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
    source: str
    model: Model
    cluster: str                   # Cluster.from_spec string
    global_batch: int              # sequences per step
    fixed: Mapping[str, Any]       # exactly what the source publishes
    metric: str                    # "tflops" (per GPU) | "tokens" (per GPU per s) | "mfu"
    published: float
    flops: str = "megatron"        # FLOP formula of the source: "megatron" | "megatron-norecompute" | "palm"
    precision: autopar.Precision = MEGATRON_BF16
    device: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # datasheet differences of the run's part
    inter_node_bandwidth: float | None = None   # per GPU per direction, when the source's network differs

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
        if self.metric == "tokens":
            return self.global_batch * self.model.seq / step_time / cluster.devices
        achieved = self.flops_per_step() / step_time / cluster.devices
        if self.metric == "mfu":
            return achieved / cluster.device.peak(self.precision.compute)
        return achieved / 1e12

    def step_time_of(self, value: float, cluster: autopar.Cluster) -> float:
        """The published step time the published metric implies (inverse of :meth:`metric_of`)."""
        return self.metric_of(1.0, cluster) / value


def _gpt(hidden: int, heads: int, layers: int, seq: int) -> Model:
    return Model("gpt", hidden, heads, layers, seq, MEGATRON_VOCAB)


def _llama(hidden: int, heads: int, kv: int, layers: int, ffn: int, seq: int) -> Model:
    return Model("llama", hidden, heads, layers, seq, LLAMA3_VOCAB, kv_heads=kv, ffn=ffn)


def _megatron(tp: int, pp: int, dp: int) -> dict[str, Any]:
    # Megatron-LM 2021: no sequence parallelism, no distributed optimizer, full recomputation of every layer
    return dict(tp=tp, pp=pp, dp=dp, cp=1, ep=1, zero=0, recompute="full", recompute_layers=0,
                sequence_parallel=False)


SC21 = "Narayanan et al. SC21 Table 1 (bench/sources.md section 1)"
# params, heads, hidden, layers, TP, PP, GPUs, global batch, published TFLOP/s per GPU
_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
TABLE1 = [Row(f"SC21 {p}B", SC21, _gpt(h, a, l, 2048), f"{g // 8}x8xA100-80GB", b, _megatron(t, pp, g // (t * pp)),
              "tflops", tf) for p, a, h, l, t, pp, g, b, tf in _TABLE1]

README = "Megatron-LM README TP weak scaling (bench/sources.md section 2)"
# name, hidden, heads, layers, TP = GPUs, published TFLOP/s (seq 1024, global batch 16)
_README_TP = [("1.2B", 1920, 15, 24, 1, 149.8), ("2.0B", 2304, 18, 30, 2, 136.8),
              ("4.2B", 3072, 24, 36, 4, 124.7), ("8.7B", 4096, 32, 42, 8, 109.3)]
README_TP = [Row(f"README {n} tp{t}", README, _gpt(h, a, l, 1024), f"1x{t}xA100-80GB", 16, _megatron(t, 1, 1),
                 "tflops", tf) for n, h, a, l, t, tf in _README_TP]

LLAMA3 = "Llama 3 405B, arXiv 2407.21783 Table 4 (bench/sources.md section 8)"
MEGASCALE = "MegaScale NSDI'24: 55.2% MFU, Megatron-LM 1.34x slower (bench/sources.md section 8)"
TORCHTITAN = "torchtitan llama3_h100_202412 benchmark, eager and torch.compile (bench/sources.md section 8)"
SHOEYBI = "Shoeybi et al. 2019, Megatron-LM on V100 (bench/sources.md section 8)"
# Meta's Grand Teton H100 (bench/sources.md section 8: 96 GB HBM2e at 2.4 TB/s, 500 W) is its own preset
# with its own constants: the power cap lowers what a GEMM sustains.
CONSTANT_FAMILIES = {"H100-96GB-500W": "H100-500W"}

SECTION8 = [
    # Llama 3 405B: published TP / CP / PP / DP, sequence and batch; the rest (micro-batch, schedule,
    # recomputation, ZeRO) is not published. TFLOP/s per GPU by PaLM's formula (assumed: the paper
    # does not give its own). The long-context row reads DP 4 in Table 4 (bench/sources.md section 8),
    # but 8 x 16 x 16 x 4 is 8,192 GPUs, not the row's 16,384, and its 16M-token batch is DP 8 x 16
    # sequences of 131,072: DP 8 it is (the planner refuses DP 4 on 16,384 GPUs, naming dp * cp * tp * pp).
    *[Row(f"Llama3-405B {g} GPUs cp{cp}", LLAMA3, _llama(16384, 128, 8, 126, 53248, seq), f"{g // 8}x8xH100-SXM",
          dp * per_dp, dict(tp=8, cp=cp, pp=16, dp=dp, ep=1), "tflops", tf, flops="palm", precision=LLAMA_BF16)
      for g, cp, dp, seq, per_dp, tf in [(8192, 1, 64, 8192, 32, 430), (16384, 1, 128, 8192, 16, 400),
                                         (16384, 16, 8, 131072, 16, 380)]],
    # GPT-3 175B on 12,288 A100 with Megatron-LM: MegaScale's 55.2% MFU / 1.34 (model FLOPs, no recompute
    # counted). Micro-batch, recomputation and sequence parallelism are not published.
    Row("MegaScale 175B Megatron-LM", MEGASCALE, _gpt(12288, 96, 96, 2048), "1536x8xA100-80GB", 6144,
        dict(tp=8, pp=8, dp=192, cp=1, ep=1), "mfu", 0.552 / 1.34, flops="megatron-norecompute"),
    # torchtitan Llama 3.1 8B: FSDP2 (ZeRO-3) over every GPU, local batch 2, eager kernels and
    # torch.compile (Precision.kernels "eager" / "compiled"). Its "selective activation checkpointing"
    # is torchtitan's default per-op policy (selective_ac_option "op": every other matmul output and
    # the attention output kept, the rest recomputed), autopar's recompute="op", pinned.
    *[Row(f"torchtitan 8B {g} GPUs {mode}", TORCHTITAN, _llama(4096, 32, 8, 32, 14336, 8192),
          f"{g // 8}x8xH100-96GB-500W", 2 * g, dict(tp=1, pp=1, cp=1, ep=1, dp=g, zero=3, micro_batch_size=2,
                                                    recompute="op", recompute_layers=0),
          "tokens", tps, flops="palm", precision=precision)
      for mode, precision, rows in [("eager", TITAN_EAGER, [(8, 5762), (128, 5605)]),
                                    ("compiled", TITAN_COMPILED, [(8, 6667), (128, 6514)])]
      for g, tps in rows],
    # Megatron-LM 2019 on V100 32 GB, fp16. The 1.2B shape (hidden 1536, 40 layers, 16 heads) and the
    # batch of 8 per replica are Shoeybi et al.'s Table 1 and section 5.1. Recomputation is not given
    # per row, so it is left free (bench/sources.md section 8), and the FLOP formula is assumed to count model
    # FLOPs (no recomputed forward), the count that does not depend on that choice.
    Row("Megatron 1.2B 1xV100", SHOEYBI, _gpt(1536, 16, 40, 1024), "1x1xV100-32GB", 8,
        dict(tp=1, pp=1, dp=1, cp=1, ep=1, zero=0, sequence_parallel=False), "tflops", 39.0,
        flops="megatron-norecompute", precision=MEGATRON_2019_FP16),
    # 8.3B: tp 8 x dp 64 on 32 DGX-2H (16 GPUs on NVSwitch each, 8 x 100 Gb/s InfiniBand per node:
    # 6.25 GB/s per GPU per direction), global batch 512; 15.1 PFLOP/s over 512 GPUs.
    Row("Megatron 8.3B 512xV100", SHOEYBI, _gpt(3072, 32, 72, 1024), "32x16xV100-32GB", 512,
        dict(tp=8, pp=1, dp=64, cp=1, ep=1, zero=0, sequence_parallel=False), "tflops", 15.1e3 / 512,
        flops="megatron-norecompute", precision=MEGATRON_2019_FP16, inter_node_bandwidth=8 * 12.5e9 / 16),
]

ROWS: list[Row] = TABLE1 + README_TP + SECTION8


@functools.lru_cache(maxsize=None)
def graph_of(model: Model):
    """The captured graph of ``model`` (meta device, bf16, batch 1), once per shape."""
    if model.family == "gpt":
        cfg = GPTConfig(vocab_size=model.vocab, hidden=model.hidden, heads=model.heads, layers=model.layers,
                        seq_len=model.seq)
        built, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    else:
        cfg = LlamaConfig(vocab_size=model.vocab, hidden=model.hidden, heads=model.heads, kv_heads=model.kv_heads,
                          layers=model.layers, ffn_hidden=model.ffn, seq_len=model.seq)
        built, inputs = build_llama(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(built, inputs)


def cluster_of(row: Row, **device: Any) -> autopar.Cluster:
    """The row's cluster; ``device`` overrides device constants (the fit scans matmul_efficiency)."""
    cluster = autopar.Cluster.from_spec(row.cluster)
    if row.inter_node_bandwidth is not None:   # nominal NIC rate; the preset's achieved fraction stays
        cluster = dataclasses.replace(cluster, inter_node=dataclasses.replace(
            cluster.inter_node, bandwidth=row.inter_node_bandwidth))
    changes = {**row.device, **device}
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **changes)) if changes else cluster


def plan_row(row: Row, **device: Any) -> autopar.Plan:
    """The planner's plan of ``row`` with everything published pinned."""
    plan, _ = solve(graph_of(row.model), cluster_of(row, **device), row.global_batch, precision=row.precision,
                    fixed=row.fixed)
    return plan
