"""What the kernels a program runs change in its price: eager, hand-fused and compiled kernels
(Precision.kernels; the minimum cut of capture/fusion.py), causal attention's skipped tiles, the fused
attention backward's recomputation, and activations counted at the dtype the model keeps them in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar import Cluster, ParallelConfig, Precision
from autopar.capture import capture
from autopar.capture import fusion
from autopar.capture.fusion import RECOMPUTABLE, SAVES, for_kernels
from autopar.capture.opgraph import OpKind
from autopar.cost_model.compute import FUSED_ATTENTION_BACKWARD, ComputeModel, fused_ops
from autopar.cost_model.memory import saved_owner
from autopar.models import GPTConfig, LlamaConfig, build_gpt, build_llama
from autopar.solver import price

H100 = Cluster.from_spec("1x8xH100-SXM")
EAGER, FUSED, COMPILED = Precision(), Precision(kernels="fused"), Precision(kernels="compiled")


@pytest.fixture(scope="module")
def llama():
    """A bf16 Llama layer stack at 1024 tokens: RMSNorm's float32 copies, rotary, GQA, SwiGLU."""
    cfg = LlamaConfig(vocab_size=512, hidden=256, heads=8, kv_heads=2, layers=2, ffn_hidden=768, seq_len=1024)
    model, inputs = build_llama(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(model, inputs)


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(vocab_size=512, hidden=256, heads=4, layers=2, seq_len=512)
    model, inputs = build_gpt(cfg, batch_size=1, device="meta", dtype=torch.bfloat16)
    return capture(model, inputs)


def _layer_saves(graph, index):
    """{root: SavedTensor} the layer owns (each storage once, charged to the first layer saving it)."""
    owner, layer = saved_owner(graph), graph.layers[index]
    return {st.root: st for n in graph.layer_nodes(layer) for st in n.saved if owner.get(st.root) == layer.index}


def _block(graph):
    return next(i for i, layer in enumerate(graph.layers) if layer.is_block)


def test_compiled_llama_layer_keeps_a_minimum_cut(llama):
    """Per token of a block, in units of the hidden size h = 256 (bytes / h): eager keeps the float32
    copies RMSNorm makes (4 bytes each), the normalised outputs, SiLU's input and output and the
    SwiGLU product; a compiled program keeps the two residual-stream inputs of the norms, q after rotary
    (or q before it), k and v, the attention output, and the gate and up projections, besides what
    eager keeps too: the two float32 rotary tables (s x d/2 each), the norms' 1/rms per token and
    attention's log-sum-exp per head and token."""
    eager = _layer_saves(llama, _block(llama))
    fused = _layer_saves(for_kernels(llama, "compiled"), _block(llama))
    per_token = lambda saves: sum(st.nbytes(2, llama.float_dtype) for st in saves.values()) / (1024 * 256)
    h, kv, ffn = 256, 64, 768
    tables, stats = 2 * 4 * 16 / h, (2 * 4 + 8 * 4) / h
    assert per_token(fused) == pytest.approx((2 * h + 2 * h + 2 * h + 2 * 2 * kv + 2 * h + 2 * 2 * ffn) / h
                                             + tables + stats, rel=1e-9)
    assert per_token(eager) > 1.8 * per_token(fused)
    # float32 copies count 4 bytes a value in eager (the model makes them on purpose)
    assert any(st.dtype == "float32" and st.nbytes(2, llama.float_dtype) == 4 * st.numel for st in eager.values())


@pytest.mark.parametrize("kernels", ["fused", "compiled"])
def test_cut_recomputes_only_from_what_it_keeps(llama, gpt, kernels):
    """Every value eager autograd saves is, fused or compiled, kept or recomputable from values the program
    keeps (or op-internal extras): compiled by element-wise, view, creation, norm or dropout ops; fused by
    element-wise, view or creation ops only, and a value an op of another kind saves (a product's input,
    a norm's input, a softmax's output) is kept as it is."""
    for graph in (llama, gpt):
        fused = for_kernels(graph, kernels)
        kept = {st.root for n in fused.nodes for st in n.saved}
        for node in graph.nodes:
            for st in node.saved:
                if ":" in st.root:
                    assert st.root in kept
                    continue
                if kernels == "fused" and node.kind not in RECOMPUTABLE["fused"]:
                    assert st.root in kept, (graph.model_name, node.name, st.root)
                todo, seen = [st.root], set()
                while todo:
                    name = todo.pop()
                    if name in kept or name in seen:
                        continue
                    seen.add(name)
                    producer = graph.node(name)       # not kept: recomputed from its inputs
                    assert producer.kind in RECOMPUTABLE[kernels], (graph.model_name, name, producer.kind)
                    todo.extend(producer.inputs)
        assert for_kernels(fused, kernels) is fused and for_kernels(graph, kernels) is fused
        assert for_kernels(graph, "eager") is graph   # autograd's saves
        with pytest.raises(ValueError):
            for_kernels(fused, "eager")


@pytest.mark.parametrize("kernels", ["fused", "compiled"])
def test_repeated_blocks_take_their_first_ones_cut(llama, gpt, kernels, monkeypatch):
    """The cut is solved once per layer signature; every other layer's is the first one's renamed, equal
    to solving it anew."""
    for graph in (llama, gpt):
        solve = fusion._layer
        calls = []
        monkeypatch.setattr(fusion, "_layer", lambda *a: calls.append(1) or solve(*a))
        cut = fusion.kernel_saves(graph, SAVES[kernels])
        monkeypatch.setattr(fusion, "_layer", solve)
        assert len(calls) == len({layer.signature for layer in graph.layers}) < len(graph.layers)
        for layer in graph.layers:
            direct = solve(graph, [graph.nodes[i] for i in layer.nodes], SAVES[kernels])
            assert {name: cut.node(name).saved for name in direct} == direct


def test_gpt_compiled_drops_what_compiled_kernels_recompute(gpt):
    """Megatron's layer, eager attention: the attention dropout's output (a copy of the softmax with
    its 1-byte mask), GeLU's output and the LayerNorm outputs are recomputed; the masks, softmax and
    GEMM outputs stay."""
    block = _block(gpt)
    eager, fused = _layer_saves(gpt, block), _layer_saves(for_kernels(gpt, "compiled"), block)
    kinds = lambda saves: sorted(gpt.node(r).kind.value for r in saves    # made inside the block
                                 if ":" not in r and gpt.node(r).layer == gpt.layers[block].index)
    assert kinds(fused).count("dropout") == 0 < kinds(eager).count("dropout")
    assert kinds(fused).count("norm") == 0 < kinds(eager).count("norm")
    assert {r for r in fused if ":" in r} == {r for r in eager if ":" in r}   # masks and statistics kept
    assert "softmax" in kinds(fused)


def test_eager_kernels_fuse_nothing_and_cost_more(llama, tmp_path):
    """Eager kernels fuse nothing; hand-fused ones fuse element-wise chains, each keeping its inputs (RMSNorm's
    float32 copies and SiLU's output are recomputed); compiled ones fuse as much and recompute across
    kernels too (the norms' outputs the projections read), so they keep the least."""
    assert fused_ops(llama, "eager") == frozenset() and fused_ops(llama, "fused") and fused_ops(llama, "compiled")
    cfg = ParallelConfig(dp=8)
    eager, fused, compiled = (price(llama, H100, cfg, 8, precision=p) for p in (EAGER, FUSED, COMPILED))
    assert eager.breakdown.compute > fused.breakdown.compute >= compiled.breakdown.compute
    assert eager.peak_memory > fused.peak_memory > compiled.peak_memory
    assert [p.precision.kernels for p in (eager, fused, compiled)] == ["eager", "fused", "compiled"]
    assert "eager kernels" in eager.summary() and "compiled kernels" in compiled.summary()
    compiled.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json").precision.kernels == "compiled"


def test_kernels_is_validated():
    with pytest.raises(autopar.ConfigError, match="kernels"):
        Precision(kernels="inductor")


def test_causal_attention_costs_what_its_kept_pairs_cost(llama):
    """is_causal: the kernel skips the masked tiles, so forward and backward take the kept share
    (s + 1) / 2s of a dense attention's time; the backward recomputes the scores (5/4 the count)."""
    node = next(n for n in llama.nodes if n.kind is OpKind.ATTENTION)
    assert node.gemm.density == pytest.approx(1025 / 2048)
    model = ComputeModel(llama, H100.device, "bf16")
    causal = model.op_time(node, 1.0, 1, "")
    dense = model.op_time(dataclasses.replace(node, gemm=dataclasses.replace(node.gemm, density=1.0)), 1.0, 1, "")
    launch = H100.device.kernel_overhead
    assert causal.fwd - launch == pytest.approx((dense.fwd - launch) * node.gemm.density, rel=1e-9)
    assert (dense.bwd - 2 * launch) / (dense.fwd - launch) == pytest.approx(2 * FUSED_ATTENTION_BACKWARD, rel=1e-9)


def test_fused_attention_runs_at_the_devices_attention_efficiency(llama):
    """A fused attention's compute time is its FLOPs at the device's attention_efficiency (FlashAttention-2's
    published speed on the H100 preset), not its GEMM efficiency; None falls back to the GEMM's. The
    projections are priced alike either way."""
    attention = next(n for n in llama.nodes if n.kind is OpKind.ATTENTION)
    projection = next(n for n in llama.nodes if n.kind is OpKind.MATMUL and n.batch_dependent)
    device = H100.device
    assert device.attention_efficiency is not None and device.attention_efficiency < device.matmul_efficiency
    as_gemm = dataclasses.replace(device, attention_efficiency=None)
    own, gemm = ComputeModel(llama, device, "bf16"), ComputeModel(llama, as_gemm, "bf16")
    launch = device.kernel_overhead
    ratio = (own.op_time(attention, 1.0, 1, "").fwd - launch) / (gemm.op_time(attention, 1.0, 1, "").fwd - launch)
    assert ratio == pytest.approx(device.matmul_efficiency / device.attention_efficiency, rel=1e-9)
    assert own.op_time(projection, 1.0, 1, "") == gemm.op_time(projection, 1.0, 1, "")


def test_parallelize_refuses_kernels_it_does_not_run(llama):
    """Hand-written fused kernels are refused by name; a compiled plan is compiled (tests/distributed)."""
    plan = price(llama, Cluster.from_spec("1x1xH100-SXM"), ParallelConfig(), 1, precision=FUSED)
    from autopar.driver.program import Program
    with pytest.raises(autopar.ConfigError, match="fused kernels"):
        Program(None, plan, None, loss_fn=None, example_inputs=None, timeout=1.0)


def test_ranks_sharing_a_machine_compute_slower(llama):
    """Device.concurrency_slowdown (measured by Cluster.local on CPU ranks) stretches every op and the
    optimizer step; it is 1 on the GPU presets and refused below 1."""
    cpu = Cluster.from_spec("1x2xcpu")
    slow = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, concurrency_slowdown=1.5))
    cfg = ParallelConfig(dp=2)
    base, slowed = (price(llama, c, cfg, 4, precision=Precision.for_device("cpu")) for c in (cpu, slow))
    assert slowed.breakdown.compute == pytest.approx(1.5 * base.breakdown.compute, rel=1e-9)
    assert slowed.breakdown.optimizer == pytest.approx(1.5 * base.breakdown.optimizer, rel=1e-9)
    assert H100.device.concurrency_slowdown == 1.0
    with pytest.raises(autopar.ConfigError, match="concurrency_slowdown"):
        dataclasses.replace(cpu.device, concurrency_slowdown=0.8)


def test_megatrons_torch_softmax_fallback_costs_its_five_fp32_passes(gpt):
    """Precision(fused_softmax=False): the attention softmax as Megatron's PyTorch fallback runs it (cast to
    fp32, scale, mask, softmax, cast back): 2d + 32 bytes a score forward and 2d + 36 backward (d = 2 in bf16)
    in five kernels, where the fused kernel's chain moves 4 and 8 in one; every other op unchanged. Only with
    hand-fused kernels: the others run no such kernel."""
    fallback = Precision(kernels="fused", fused_softmax=False)
    fused_away = fused_ops(gpt, "fused")
    node = next(n for n in gpt.nodes if n.kind is OpKind.SOFTMAX)
    assert node.name not in fused_away
    kernel, torch_softmax = (ComputeModel(gpt, H100.device, "bf16", kernels="fused", fused_softmax=f)
                             for f in (True, False))
    device = H100.device
    bandwidth, launch = device.memory_bandwidth * device.memory_efficiency, device.kernel_overhead
    scores = node.outputs[0].numel
    one, five = kernel.op_time(node, 1.0, 1, "", fused_away), torch_softmax.op_time(node, 1.0, 1, "", fused_away)
    assert one.fwd == pytest.approx(4 * scores / bandwidth + launch)
    assert five.fwd == pytest.approx(36 * scores / bandwidth + 5 * launch)
    assert five.bwd == pytest.approx(40 * scores / bandwidth + 10 * launch)
    assert len(node.outputs[0].shape) == 4     # [batch, heads, queries, keys]: a router's softmax is not one
    router = dataclasses.replace(node, name="router", outputs=(dataclasses.replace(node.outputs[0], shape=(64, 8)),))
    assert torch_softmax.op_time(router, 1.0, 1, "") == kernel.op_time(router, 1.0, 1, "")
    others = [n for n in gpt.nodes if n.kind is not OpKind.SOFTMAX]
    assert all(kernel.op_time(n, 1.0, 1, "", fused_away) == torch_softmax.op_time(n, 1.0, 1, "", fused_away)
               for n in others)
    cfg = ParallelConfig(dp=8)
    assert price(gpt, H100, cfg, 8, precision=fallback).step_time > price(gpt, H100, cfg, 8, precision=FUSED).step_time
    for kernels in ("eager", "compiled"):
        with pytest.raises(autopar.ConfigError, match="kernels=\"fused\""):
            Precision(kernels=kernels, fused_softmax=False)
    with pytest.raises(autopar.ConfigError, match="True or False"):
        Precision(kernels="fused", fused_softmax="no")


def test_reports_say_the_softmax_ran_as_pytorch(gpt):
    cfg = ParallelConfig(dp=8)
    fused = price(gpt, H100, cfg, 8, precision=FUSED)
    fallback = price(gpt, H100, cfg, 8, precision=Precision(kernels="fused", fused_softmax=False))
    assert "fused kernels" in fused.summary() and "PyTorch softmax" not in fused.summary()
    assert "fused (PyTorch softmax) kernels" in fallback.summary()
    assert "PyTorch softmax" in str(fused.compare(fallback))


def test_megatrons_torch_softmax_keeps_fp32_probabilities(gpt):
    """Without recomputation the fallback's softmax saves its fp32 output where the fused kernel saves bf16
    probabilities: 2 more bytes a score in every layer's activations; full recomputation keeps neither."""
    scores = sum(n.outputs[0].numel for n in gpt.nodes if n.kind is OpKind.SOFTMAX)
    fallback = Precision(kernels="fused", fused_softmax=False)
    for recompute, extra in (("none", 2 * scores), ("full", 0)):
        cfg = ParallelConfig(dp=8, recompute=recompute)
        fused, torch_softmax = (price(gpt, H100, cfg, 8, precision=p) for p in (FUSED, fallback))
        assert (torch_softmax.stages[0].activation_per_microbatch
                - fused.stages[0].activation_per_microbatch) == pytest.approx(extra)
