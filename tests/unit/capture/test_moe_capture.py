"""Mixture-of-experts capture (autopar/capture/moe.py): regions, their inputs and parameters, routed FLOPs.

Models: Hugging Face transformers v5 Mixtral and Qwen2-MoE (Qwen3-MoE too) with each experts
implementation ("eager" is exported as "grouped_mm"), autopar.models.moe's Mixtral (static
capacity dispatch), a user-written MoE with other names, and dense models (no region, nothing
changed). The FLOPs are exact: every count is an integer well below 2**53, so float sums of
them are exact and compared with ``==``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
import autopar.capture as capture_pkg
from autopar.capture import MoERegion, OpGraph, capture
from autopar.capture.moe import static_experts
from autopar.errors import CaptureError
from autopar.models.moe import MixtralConfig, build_mixtral

os.environ.setdefault("HF_HUB_OFFLINE", "1")

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
# Tiny sizes: 2 layers, h=32, 4/2 heads, 4 experts top-2, vocab 64, batch 2 x seq 8 (T = 16).
LAYERS, HIDDEN, EXPERTS, TOP_K, BATCH, SEQ = 2, 32, 4, 2, 2, 8
TOKENS = BATCH * SEQ
HF_FFN = {"mixtral": 64, "qwen2_moe": 48, "qwen3_moe": 48}


def _hf(family: str, implementation: str, device: str = "cpu"):
    pytest.importorskip("transformers", reason="transformers is the optional dev extra")
    from autopar.models import hf
    sizes = dict(layers=LAYERS, hidden=HIDDEN, heads=4, kv_heads=2, ffn_hidden=HF_FFN[family], num_experts=EXPERTS,
                 top_k=TOP_K, vocab=64, seq_len=SEQ, batch_size=BATCH, device=device,
                 experts_implementation=implementation)
    if family == "qwen2_moe":
        return hf.build_hf_qwen2_moe(shared_ffn_hidden=64, **sizes)
    if family == "qwen3_moe":
        return hf.build_hf_qwen3_moe(**sizes)
    return hf.build_hf_mixtral(**sizes)


def routed_fwd(tokens: int, k: int, h: int, f: int) -> float:
    """2 T k (2f) h (gate_up) + 2 T k f h (down) + T k f (activation) + T k f (act * up)."""
    return 2.0 * tokens * k * 2 * f * h + 2.0 * tokens * k * f * h + 2.0 * tokens * k * f


def routed_bwd(tokens: int, k: int, h: int, f: int) -> float:
    """Twice each GEMM (input and weight gradients) and twice each element-wise op."""
    return 2.0 * routed_fwd(tokens, k, h, f)


def check_region(graph: OpGraph, r: MoERegion, *, tokens: int, k: int, e: int, h: int, f: int) -> None:
    """The invariants every region must satisfy, whatever the implementation."""
    assert (r.tokens, r.top_k, r.num_experts, r.hidden, r.ffn) == (tokens, k, e, h, f)
    assert graph.params[r.gate_up].shape == (e, 2 * f, h) and graph.params[r.down].shape == (e, h, f)
    assert r.gate_up.startswith(r.module + ".") and r.down.startswith(r.module + ".")
    metas = {gi.name: gi.meta for gi in graph.inputs} | {n.name: n.outputs[0] for n in graph.nodes}
    assert metas[r.hidden_input].shape == (tokens, h) and metas[r.hidden_input].is_float
    assert metas[r.index_input].shape == (tokens, k) and metas[r.index_input].dtype == "int64"
    assert metas[r.weight_input].shape == (tokens, k) and metas[r.weight_input].is_float
    assert r.output in r.nodes and graph.node(r.output).outputs[0].shape == (tokens, h)
    # The inputs come from outside the experts module, its nodes from inside it.
    assert not {r.hidden_input, r.index_input, r.weight_input} & set(r.nodes)
    for name in r.nodes:
        node = graph.node(name)
        assert node.module_path == r.module or node.module_path.startswith(r.module + ".")
        assert node.layer == r.layer and not node.attention_core
    assert r.router is not None and graph.params[r.router].shape in ((e, h), (h, e))
    nodes = [graph.node(n) for n in r.nodes]
    assert sum(n.flops_fwd for n in nodes) == routed_fwd(tokens, k, h, f)
    assert sum(n.flops_bwd for n in nodes) == routed_bwd(tokens, k, h, f)


# --- Hugging Face ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_graphs():
    cache: dict = {}

    def get(family: str, implementation: str):
        if (family, implementation) not in cache:
            model, inputs = _hf(family, implementation)
            cache[family, implementation] = (model, capture(model, inputs))
        return cache[family, implementation]
    return get


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_hf_one_region_per_layer(hf_graphs, family: str, implementation: str) -> None:
    model, graph = hf_graphs(family, implementation)
    assert [r.module for r in graph.moe] == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    for i, r in enumerate(graph.moe):
        check_region(graph, r, tokens=TOKENS, k=TOP_K, e=EXPERTS, h=HIDDEN, f=HF_FFN[family])
        assert graph.layers[r.layer].name == f"model.layers.{i}"
        assert r.gate_up == f"model.layers.{i}.mlp.experts.gate_up_proj"
        assert r.down == f"model.layers.{i}.mlp.experts.down_proj"
        assert r.router == f"model.layers.{i}.mlp.gate.weight"
        assert r.activation == "silu"
        # The router's top-k feeds the experts: the ids are a topk output, the tokens what the router reads.
        assert graph.node(r.index_input).inputs and "topk" in graph.node(graph.node(r.index_input).inputs[0]).target
    # Qwen2-MoE's shared expert is a dense MLP beside the experts: not part of the region.
    assert not any("shared_expert" in graph.node(n).module_path for r in graph.moe for n in r.nodes)
    assert graph.param_numel == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_hf_eager_is_captured_as_grouped_mm(hf_graphs, family: str) -> None:
    """The eager loop cannot be exported (nonzero, torch.where); the same maths with grouped_mm is,
    the model is left as it was, and the graph says what happened."""
    model, graph = hf_graphs(family, "eager")
    assert model.config._experts_implementation == "eager"
    assert any("experts_implementation='eager'" in w and "'grouped_mm'" in w for w in graph.warnings)
    _, grouped = hf_graphs(family, "grouped_mm")
    assert [n.target for n in graph.nodes] == [n.target for n in grouped.nodes]
    assert not grouped.warnings


def test_hf_batched_mm_recounts_per_assignment_products(hf_graphs) -> None:
    """batched_mm computes T*k matrix-vector products on gathered weights: routed already; the
    region's other ops (gathers, combine) count nothing."""
    _, graph = hf_graphs("mixtral", "batched_mm")
    r = graph.moe[0]
    products = [graph.node(n) for n in r.nodes if graph.node(n).target == "aten.bmm.default"]
    f = HF_FFN["mixtral"]
    assert [p.flops_fwd for p in products] == [2.0 * TOKENS * TOP_K * 2 * f * HIDDEN, 2.0 * TOKENS * TOP_K * f * HIDDEN]


def test_hf_qwen3_moe() -> None:
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, "Qwen3MoeForCausalLM"):
        pytest.skip(f"transformers {tf.__version__} has no Qwen3-MoE")
    model, inputs = _hf("qwen3_moe", "grouped_mm", device="meta")
    graph = capture(model, inputs)
    assert len(graph.moe) == LAYERS
    for r in graph.moe:
        check_region(graph, r, tokens=TOKENS, k=TOP_K, e=EXPERTS, h=HIDDEN, f=HF_FFN["qwen3_moe"])


def test_static_experts_restores_on_error() -> None:
    model, _ = _hf("mixtral", "eager", device="meta")
    with pytest.raises(RuntimeError, match="boom"):
        with static_experts(model) as used:
            assert used == "grouped_mm" and model.config._experts_implementation == "grouped_mm"
            raise RuntimeError("boom")
    assert model.config._experts_implementation == "eager"


# --- autopar.models.moe ------------------------------------------------------------------------

OURS = dict(hidden=HIDDEN, heads=4, kv_heads=2, layers=LAYERS, ffn_hidden=48, vocab_size=64, seq_len=SEQ,
            num_experts=EXPERTS, top_k=TOP_K)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_hand_written_mixtral(capacity_factor: float | None) -> None:
    """The static dispatch computes E*T slots (no capacity) or E*C = T*k (capacity 1.0): both count T*k."""
    model, inputs = build_mixtral(MixtralConfig(**OURS, capacity_factor=capacity_factor), batch_size=BATCH,
                                  device="meta")
    graph = capture(model, inputs)
    assert [r.module for r in graph.moe] == [f"layers.{i}.moe.experts" for i in range(LAYERS)]
    for i, r in enumerate(graph.moe):
        check_region(graph, r, tokens=TOKENS, k=TOP_K, e=EXPERTS, h=HIDDEN, f=48)
        assert (r.gate_up, r.down) == (f"layers.{i}.moe.experts.gate_up_proj", f"layers.{i}.moe.experts.down_proj")
        assert r.router == f"layers.{i}.moe.router.weight" and r.activation == "silu"
        assert graph.layers[r.layer].name == f"layers.{i}"
    assert not graph.warnings


def test_capacity_below_load_counts_the_rows_computed() -> None:
    """capacity_factor 0.5 runs E*C = T*k/2 rows: the dropped half is not computed, nor counted."""
    model, inputs = build_mixtral(MixtralConfig(**OURS, capacity_factor=0.5), batch_size=BATCH, device="meta")
    graph = capture(model, inputs)
    for r in graph.moe:
        assert sum(graph.node(n).flops_fwd for n in r.nodes) == routed_fwd(TOKENS // 2, TOP_K, HIDDEN, 48)


# --- a user's own MoE --------------------------------------------------------------------------

class Scorer(nn.Module):
    def __init__(self, h: int, e: int) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(e, h) * 0.02)


class RoutedFFN(nn.Module):
    """Every expert on every token (E*T rows), combined by a [T, E] matrix of the top-k weights."""

    def __init__(self, e: int, h: int, f: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(e, 2 * f, h) * 0.02)
        self.w_out = nn.Parameter(torch.randn(e, h, f) * 0.02)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,eoh->eto", x, self.w_in).chunk(2, dim=-1)
        y = torch.einsum("etf,ehf->eth", F.gelu(gate, approximate="tanh") * up, self.w_out)
        combine = torch.zeros(x.shape[0], self.w_in.shape[0], dtype=x.dtype, device=x.device).scatter(1, ids, wts)
        return torch.einsum("eth,te->th", y, combine)


class ActFFN(RoutedFFN):
    """RoutedFFN with another activation between the two products."""

    act = staticmethod(torch.tanh)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,eoh->eto", x, self.w_in).chunk(2, dim=-1)
        y = torch.einsum("etf,ehf->eth", self.act(gate) * up, self.w_out)
        combine = torch.zeros(x.shape[0], self.w_in.shape[0], dtype=x.dtype, device=x.device).scatter(1, ids, wts)
        return torch.einsum("eth,te->th", y, combine)


class LoopFFN(RoutedFFN):
    """The Hugging Face eager pattern in user code: a loop over the experts hit (data-dependent)."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            pos, tok = torch.where(ids.t() == e)
            gate, up = F.linear(x[tok], self.w_in[e]).chunk(2, dim=-1)
            out = out.index_add(0, tok, F.linear(F.silu(gate) * up, self.w_out[e]) * wts[tok, pos, None])
        return out


class Block(nn.Module):
    def __init__(self, h: int, e: int, f: int, k: int, ffn: type[RoutedFFN]) -> None:
        super().__init__()
        self.k = k
        self.scorer = Scorer(h, e)
        self.ffn = ffn(e, h, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        wts, ids = torch.softmax(flat @ self.scorer.proj.t(), dim=-1).topk(self.k, dim=-1)
        return x + self.ffn(flat, ids, wts).view_as(x)


class ToyMoE(nn.Module):
    def __init__(self, ffn: type[RoutedFFN] = RoutedFFN, vocab: int = 64, h: int = HIDDEN, e: int = EXPERTS,
                 f: int = 24, k: int = TOP_K) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList([Block(h, e, f, k, ffn) for _ in range(LAYERS)])
        self.head = nn.Linear(h, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_user_written_moe_is_recognised() -> None:
    model = ToyMoE()
    graph = capture(model, (torch.randint(0, 64, (BATCH, SEQ)),))
    assert [r.module for r in graph.moe] == ["blocks.0.ffn", "blocks.1.ffn"]
    for i, r in enumerate(graph.moe):
        check_region(graph, r, tokens=TOKENS, k=TOP_K, e=EXPERTS, h=HIDDEN, f=24)
        assert (r.gate_up, r.down, r.router) == (f"blocks.{i}.ffn.w_in", f"blocks.{i}.ffn.w_out",
                                                 f"blocks.{i}.scorer.proj")
        assert r.activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize("act, name", [(torch.tanh, "tanh"), (torch.sigmoid, "sigmoid"), (F.mish, "mish"),
                                       (F.leaky_relu, "leaky_relu"), (lambda t: F.leaky_relu(t, 0.2), ""),
                                       (lambda t: F.elu(t, alpha=0.5), "")])
def test_activation_names_are_what_expert_parallelism_runs(act, name: str) -> None:
    """Every name capture gives is one the expert-parallel call computes (runtime ACTIVATIONS), and
    an activation at non-default parameters gets no name: the planner then offers no ep or cp."""
    from autopar.cost_model import context_parallel, expert_parallel
    from autopar.runtime.expert_parallel import ACTIVATIONS
    ffn = type("Act", (ActFFN,), {"act": staticmethod(act)})
    graph = capture(ToyMoE(ffn), (torch.randint(0, 64, (BATCH, SEQ)),))
    assert [r.activation for r in graph.moe] == [name] * LAYERS
    if name:
        assert name in ACTIVATIONS and expert_parallel.unsupported(graph, 2) is None
    else:
        assert "did not recognise the activation" in expert_parallel.unsupported(graph, 2)
        assert "did not recognise the activation" in context_parallel.unsupported(graph, 2)


def test_data_dependent_experts_loop_says_what_to_use() -> None:
    with pytest.raises(CaptureError, match="experts_implementation='grouped_mm'"):
        capture(ToyMoE(LoopFFN), (torch.randint(0, 64, (BATCH, SEQ)),))


# --- dense models: nothing changes -------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt-tiny", "llama-hf"])
def test_dense_model_has_no_region_and_is_unchanged(monkeypatch, name: str) -> None:
    """No region, and the graph (fingerprint, FLOPs, every node) is what it is without the MoE pass."""
    if name == "llama-hf":
        pytest.importorskip("transformers")
        from autopar.models.hf import build_hf_llama
        model, inputs = build_hf_llama(hidden=32, seq_len=SEQ, device="meta")
    else:
        from autopar.models import build
        model, inputs = build(name, batch_size=2, device="meta")
    graph = capture(model, inputs)
    assert graph.moe == ()
    monkeypatch.setattr(capture_pkg, "find_regions", lambda *a, **k: ())
    without = capture(model, inputs)
    assert graph == without and graph.fingerprint == without.fingerprint


# --- planning still runs -----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["hf-mixtral", "hand-written"])
def test_plan_runs(which: str) -> None:
    if which == "hf-mixtral":
        model, inputs = _hf("mixtral", "grouped_mm", device="meta")
    else:
        model, inputs = build_mixtral(MixtralConfig(**OURS, capacity_factor=1.0), batch_size=BATCH, device="meta")
    plan = autopar.plan(model, autopar.Cluster.from_spec("1x2xA100-80GB"), inputs, global_batch_size=4,
                        verbose=False)
    assert plan.fits and plan.step_time > 0 and plan.config.devices == 2
