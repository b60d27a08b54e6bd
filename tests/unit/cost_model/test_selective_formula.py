"""Selective recomputation keeps what Megatron-LM's keeps, whatever the attention implementation: the
activation bytes one layer keeps per micro-batch under ``recompute="selective"`` with the program's
hand-fused kernels (``Precision(kernels="fused")``, Megatron's) against Korthikanti et al.'s count
(arXiv 2205.05198, section 4), on Hugging Face GPT-2 and Llama with eager and SDPA attention and on
autopar's own GPT.

The formula, per layer and sample of ``s`` tokens, 16-bit activations, 1-byte dropout masks:

- GPT (LayerNorm, GeLU MLP of 4h, dropout): ``34 s h`` (Korthikanti's ``sbh (10 + 24)`` with the
  attention core recomputed), divided by ``t`` under tensor and sequence parallelism.
- Llama (RMSNorm, SwiGLU of width F, rotary, no dropout), counted the same way, tensor by tensor:
  attention 2 (norm input) + 2 (QKV input) + 2 (Q) + 4 kv/a (K, V) + 2 (output-projection input);
  MLP 2 (norm input) + 2 (gate/up input) + 4 F/h (the fused SwiGLU's input) + 2 F/h (down-projection
  input): ``s h (8 + 4 kv/a + 4 + 6 F/h)``.

What the formula leaves out, added exactly: the norms' float32 statistics (LayerNorm's mean and 1/std,
8 bytes a token each; RMSNorm's 1/rms, 4 bytes). What does not grow with the micro-batch (RoPE's tables,
the causal mask) is outside the formula: the bytes are the slope between micro-batch 1 and 2, as the
formula's ``b``. No tolerance: the count is the formula plus those statistics, to the byte (a layer's
bytes do not depend on the layer count, so two layers suffice; the formula is linear in ``s``, ``h``
and ``1/t``, so a narrow model checks it).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from autopar import Cluster, Precision
from autopar.capture import capture
from autopar.capture.fusion import for_kernels
from autopar.capture.opgraph import OpKind
from autopar.cost_model.comm import place_axes
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.models import GPTConfig, build_gpt
from autopar.solver.sharding_solver import ShardingSolver

FUSED = Precision(kernels="fused")
S, H, A, F = 256, 256, 4, 688      # Llama's SwiGLU width F: not a multiple of h, to check its term


@functools.lru_cache(maxsize=None)
def _hf(family: str, attention: str, hidden: int = H, heads: int = A, seq: int = S):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        if family == "gpt2":
            config = transformers.GPT2Config(n_embd=hidden, n_layer=2, n_head=heads, n_positions=seq,
                                             vocab_size=512, use_cache=False, attn_implementation=attention)
            model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=F, num_hidden_layers=2,
                                              num_attention_heads=heads, num_key_value_heads=heads // 2,
                                              vocab_size=512, max_position_embeddings=seq, use_cache=False,
                                              attn_implementation=attention)
            model = transformers.LlamaForCausalLM(config)
        model = model.to(torch.bfloat16).train()
        ids = torch.zeros(1, seq, dtype=torch.long)
    return capture(model, {"input_ids": ids, "labels": ids})


@functools.lru_cache(maxsize=None)
def _own_gpt():
    cfg = GPTConfig(vocab_size=512, hidden=H, heads=A, layers=2, seq_len=S, dropout=0.1, attention="eager")
    model, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(model, inputs)


def formula(family: str, s: int, h: int, t: int, heads: int = A) -> float:
    """Korthikanti's bytes per layer and sample (module docstring), with the norms' statistics."""
    if family == "llama":
        return s * h * (8 + 4 * (heads // 2) / heads + 4 + 6 * F / h) / t + 2 * 4 * s / t
    return 34 * s * h / t + 2 * 8 * s / t


def kept_per_sample(graph, tp: int = 1, sp: bool = False) -> float:
    """A block's selective-recompute activation bytes per sample on one device: the slope between
    micro-batch 1 and 2, priced as the estimate prices it (the fused program's saves; tp > 1: the
    sharding ILP's layout)."""
    graph = for_kernels(graph, FUSED.kernels)
    cluster = Cluster.from_spec(f"1x{tp}xA100-80GB")
    layout = ShardingSolver(graph, cluster, FUSED).layout_fn("fast") if tp > 1 else None
    costs = LayerCostModel(graph, cluster, FUSED, **({"layout_fn": layout} if layout else {}))
    group = place_axes(cluster, [("tp", tp)])["tp"]
    block = next(layer for layer in graph.layers if layer.is_block)
    one, two = (costs.cost(block, tp, sp, b, "selective", group).activations for b in (1, 2))
    return two - one


CASES = [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "eager"), ("llama", "sdpa")]


@pytest.mark.parametrize("family,attention", CASES, ids=lambda v: v)
def test_hf_selective_keeps_korthikanti_bytes(family, attention):
    """Unfused attention (QK^T, scale, mask, softmax, dropout, PV) or SDPA: selective recompute reruns the
    core and keeps Q, K, V and its output; the MLP's fused GeLU / SwiGLU keeps its input, not each
    element-wise step of a tanh-GeLU or the float32 copies of a written-out RMSNorm."""
    assert kept_per_sample(_hf(family, attention)) == formula(family, S, H, 1)


def test_own_gpt_selective_keeps_korthikanti_bytes():
    assert kept_per_sample(_own_gpt()) == formula("gpt", S, H, 1)


def test_hf_gpt2_eager_tensor_and_sequence_parallel():
    """The issue's configuration at a width where the sharding ILP splits as Megatron does (tp=8, sequence
    parallelism): every kept tensor divides by t, 34 s h / t (was 58 s h / t: the tanh-GeLU's
    intermediates)."""
    h, heads, s, t = 2048, 16, 1024, 8
    graph = _hf("gpt2", "eager", hidden=h, heads=heads, seq=s)
    assert kept_per_sample(graph, t, True) == formula("gpt", s, h, t)


@pytest.mark.parametrize("model", [*CASES, "own-gpt"], ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_core_is_what_the_runtime_checkpoints(model):
    """The runtime recomputes each run of consecutive core ops of a layer under one checkpoint
    (codegen/layers.py), which keeps the run's inputs, and the ops after it keep what they read of it;
    the memory model frees what core ops save of values the core made. The two agree when each attention
    is one run whose only value read after it is the attention's output (the value product's, or the
    fused op's), not the s x s probabilities or scores."""
    graph = _own_gpt() if model == "own-gpt" else _hf(*model)
    for layer in (layer for layer in graph.layers if layer.is_block):
        nodes = list(graph.layer_nodes(layer))
        flags = "".join("c" if n.attention_core else "." for n in nodes)
        runs = [run for run in flags.split(".") if run]
        assert len(runs) == 1, flags                       # one attention per block, one run
        core = {n.name for n in nodes if n.attention_core}
        read_after = {src for n in nodes if not n.attention_core for src in n.inputs if src in core}
        assert len(read_after) == 1
        out = graph.node(read_after.pop())
        assert out.kind is OpKind.ATTENTION or (out.kind is OpKind.MATMUL and not out.params)
        assert out.outputs[0].shape[-1] == H // A          # per head: (b, heads, s, d), not (b, heads, s, s)
