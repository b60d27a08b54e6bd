"""Precision(compute="fp8"): which ops run in fp8, what their GEMMs and casts cost, the devices that refuse it,
and what parallelize does with such a plan."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.capture import capture
from autopar.config import ParallelConfig, Precision
from autopar.cost_model import estimate_plan
from autopar.cost_model.compute import ComputeModel, gemm_efficiency, scaled_gemm
from autopar.cost_model.low_precision import (RECIPES, RESCALE_BYTES, RESCALE_KERNELS, ROWWISE_GEMM_SHARE,
                                               cast_bytes_per_element, check_device, is_fp8_linear)
from autopar.errors import ConfigError
from autopar.models import build
from autopar.presets import DEVICE_PRESETS
from autopar.solver.plan_search import price


@pytest.fixture(scope="module")
def llama():
    model, inputs = build("llama3-8b", batch_size=1, seq_len=1024)
    return capture(model, inputs, progress=False)


def test_precision_fp8_keeps_bf16_storage_and_checks_its_recipe():
    p = Precision(compute="fp8")
    assert p.recipe == "tensorwise" and p.storage == "bf16"
    assert (p.weight_bytes, p.activation_bytes, p.optimizer_bytes) == (2, 2, 12)
    assert Precision(compute="fp8", recipe="mxfp8").recipe == "mxfp8"
    with pytest.raises(ConfigError, match="recipe='blockwise' is not one of"):
        Precision(compute="fp8", recipe="blockwise")
    with pytest.raises(ConfigError, match='pass compute="fp8"'):
        Precision(recipe="rowwise")
    assert Precision(**p.to_dict()) == p
    # around the fp8 GEMMs a model left in fp32: its weights and activations priced in fp32
    kept = Precision(compute="fp8", fp8_storage="fp32")
    assert kept.storage == "fp32" and (kept.weight_bytes, kept.activation_bytes, kept.master_bytes) == (4, 4, 0)
    with pytest.raises(ConfigError, match="fp8_storage='fp8' is not one of"):
        Precision(compute="fp8", fp8_storage="fp8")
    with pytest.raises(ConfigError, match='pass compute="fp8" with it, or drop fp8_storage'):
        Precision(fp8_storage="fp32")
    # gradients default to the weights' dtype (as a program keeps them); Megatron-LM's fp32 main grads by name
    assert (Precision().grads, Precision(compute="fp32").grads, kept.grads) == ("bf16", "fp32", "fp32")
    assert Precision(grads="fp32").grad_bytes == 4 and Precision(compute="fp16").grads == "fp16"


def test_devices_without_the_recipes_tensor_cores_refuse_it():
    with pytest.raises(ConfigError, match="A100-80GB does not have.*plan in bf16"):
        check_device(DEVICE_PRESETS["A100-80GB"], Precision(compute="fp8"))
    with pytest.raises(ConfigError, match="mxfp8 tensor cores.*use recipe 'tensorwise'"):
        check_device(DEVICE_PRESETS["H100-SXM"], Precision(compute="fp8", recipe="mxfp8"))
    check_device(DEVICE_PRESETS["B200"], Precision(compute="fp8", recipe="mxfp8"))
    check_device(DEVICE_PRESETS["MI300X"], Precision(compute="fp8"))
    model, inputs = build("gpt-tiny", batch_size=1)
    with pytest.raises(ConfigError, match="does not have"):
        autopar.plan(model, autopar.Cluster.from_spec("1x8xA100-80GB"), inputs, global_batch_size=8,
                     precision=Precision(compute="fp8"), verbose=False)


def test_the_linear_layers_run_in_fp8_and_nothing_else(llama):
    fp8 = {n.name for n in llama.nodes if is_fp8_linear(n)}
    linears = {n.name for n in llama.nodes if n.module_type == "Linear"}
    assert fp8 == linears and len(fp8) == 32 * 7 + 1     # q k v o gate up down per block, and the head
    assert not any(is_fp8_linear(n) for n in llama.nodes if n.kind.name in ("ATTENTION", "EMBEDDING"))
    model, inputs = build("mixtral-tiny", batch_size=1)
    moe = capture(model, inputs, progress=False)
    experts = [n for n in moe.nodes if "experts" in n.module_path and n.gemm is not None]
    assert experts and not any(is_fp8_linear(n) for n in experts)   # grouped expert GEMMs stay bf16


def test_an_fp8_linear_costs_its_gemms_at_the_fp8_peak_plus_its_casts(llama):
    node = next(n for n in llama.nodes if is_fp8_linear(n) and n.gemm.n == 14336)
    h100 = DEVICE_PRESETS["H100-SXM"]
    no_casts = dataclasses.replace(h100, memory_bandwidth=1e30, kernel_overhead=0.0)
    bf16 = ComputeModel(llama, no_casts, "bf16").op_time(node, 1.0, 1, "")
    fp8 = ComputeModel(llama, no_casts, "bf16", fp8=RECIPES["tensorwise"],
                       kernels="compiled").op_time(node, 1.0, 1, "")
    g = scaled_gemm(node.gemm, 1.0, "", 1)
    speed = (h100.peak("fp8") * gemm_efficiency(h100, g, fp8=True)) / (h100.peak("bf16") * gemm_efficiency(h100, g))
    assert bf16.fwd / fp8.fwd == pytest.approx(speed, rel=1e-9) and bf16.bwd / fp8.bwd == pytest.approx(speed, rel=1e-9)
    assert 1.5 < speed < 2.0
    # the weight gradient in bf16: half the backward at each speed
    hp = ComputeModel(llama, no_casts, "bf16", fp8=RECIPES["rowwise_with_gw_hp"], kernels="compiled")
    assert hp.op_time(node, 1.0, 1, "").bwd == pytest.approx(bf16.bwd / 2 + fp8.bwd / 2, rel=1e-9)
    # the casts: six operands at the device's streaming bandwidth, eager kernels moving 17/3 the bytes
    on = dict(fp8=RECIPES["tensorwise"])
    compiled = ComputeModel(llama, h100, "bf16", kernels="compiled", **on).op_time(node, 1.0, 1, "")
    eager = ComputeModel(llama, h100, "bf16", kernels="eager", **on).op_time(node, 1.0, 1, "")
    gemm_fwd = ComputeModel(llama, no_casts, "bf16", kernels="compiled", **on).op_time(node, 1.0, 1, "").fwd
    elements = g.m * g.k + g.k * g.n
    stream = h100.memory_bandwidth * h100.memory_efficiency
    assert compiled.fwd - gemm_fwd == pytest.approx(elements * 3 / stream + 3 * h100.kernel_overhead, rel=1e-9)
    assert eager.fwd - gemm_fwd == pytest.approx(elements * 17 / stream + 11 * h100.kernel_overhead, rel=1e-9)
    assert cast_bytes_per_element(RECIPES["mxfp8"], "eager") == pytest.approx(3 + 1 / 32)


def test_row_wise_recipes_run_their_forward_gemm_at_the_row_wise_kernels_share(llama):
    """torchao runs a row-wise recipe's forward GEMM on the row-wise kernel (ROWWISE_GEMM_SHARE of the tensor-wise
    kernel's throughput) and its backward GEMMs on the tensor-wise kernel, rescaling their outputs after."""
    node = next(n for n in llama.nodes if is_fp8_linear(n) and n.gemm.n == 14336)
    h100 = DEVICE_PRESETS["H100-SXM"]
    no_casts = dataclasses.replace(h100, memory_bandwidth=1e30, kernel_overhead=0.0)

    def op(device, recipe, kernels="compiled"):
        fp8 = RECIPES[recipe] if isinstance(recipe, str) else recipe
        return ComputeModel(llama, device, "bf16", fp8=fp8, kernels=kernels).op_time(node, 1.0, 1, "")

    share = RECIPES["rowwise"].gemm_share
    assert share == RECIPES["rowwise_with_gw_hp"].gemm_share == ROWWISE_GEMM_SHARE and 0.5 < share < 1
    assert RECIPES["tensorwise"].gemm_share == RECIPES["mxfp8"].gemm_share == 1.0
    assert RECIPES["tensorwise"].rescaled_grads == RECIPES["mxfp8"].rescaled_grads == 0
    bf16 = ComputeModel(llama, no_casts, "bf16").op_time(node, 1.0, 1, "")
    tensorwise, rowwise, hp = (op(no_casts, r) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    # the forward GEMM: the tensor-wise one's time over the share; tensor-wise itself at P_fp8 e_8 (test above)
    g = scaled_gemm(node.gemm, 1.0, "", 1)
    assert tensorwise.fwd == pytest.approx(node.flops_fwd / (h100.peak("fp8") * gemm_efficiency(h100, g, fp8=True)),
                                           rel=1e-9)
    assert rowwise.fwd == pytest.approx(tensorwise.fwd / share, rel=1e-9)
    assert hp.fwd == pytest.approx(tensorwise.fwd / share, rel=1e-9)
    # the backward GEMMs run on the tensor-wise kernel; rowwise_with_gw_hp's weight gradient stays bf16's
    assert rowwise.bwd == pytest.approx(tensorwise.bwd, rel=1e-9)
    assert hp.bwd == pytest.approx(bf16.bwd / 2 + tensorwise.bwd / 2, rel=1e-9)
    # the rescales at the streaming bandwidth: dx (m x k) and dW (k x n), dx alone with dW in bf16
    stream = h100.memory_bandwidth * h100.memory_efficiency
    dx, dw = g.m * g.k, g.k * g.n
    for kernels, mode in (("compiled", "fused"), ("fused", "fused"), ("eager", "eager")):
        per, launches = RESCALE_BYTES[mode], RESCALE_KERNELS[mode] * h100.kernel_overhead
        unscaled = {r: dataclasses.replace(RECIPES[r], rescaled_grads=0) for r in ("rowwise", "rowwise_with_gw_hp")}
        assert (op(h100, "rowwise", kernels).bwd - op(h100, unscaled["rowwise"], kernels).bwd
                == pytest.approx((dx + dw) * per / stream + 2 * launches, rel=1e-9))
        assert (op(h100, "rowwise_with_gw_hp", kernels).bwd - op(h100, unscaled["rowwise_with_gw_hp"], kernels).bwd
                == pytest.approx(dx * per / stream + launches, rel=1e-9))
        # the casts are tensor-wise's: the row-wise forward differs by the GEMM's shortfall alone
        assert (op(h100, "rowwise", kernels).fwd - op(h100, "tensorwise", kernels).fwd
                == pytest.approx(tensorwise.fwd * (1 / share - 1), rel=1e-9))
    assert RESCALE_BYTES["eager"] == 2 * 4 + 4 and RESCALE_BYTES["fused"] == 2 + 2


def test_plans_in_fp8(llama):
    cluster = autopar.Cluster.from_spec("1x8xH100-SXM")
    cfg = ParallelConfig(dp=8, zero=3, recompute="op")
    bf16 = estimate_plan(llama, cluster, cfg, 8, precision=Precision(kernels="compiled"))
    fp8 = estimate_plan(llama, cluster, cfg, 8, precision=Precision(compute="fp8", kernels="compiled"))
    assert fp8.step_time < bf16.step_time and fp8.peak_memory == pytest.approx(bf16.peak_memory)
    assert fp8.mfu == pytest.approx(fp8.model_flops / (fp8.step_time * 8 * 989e12))   # over the bf16 peak
    eager = estimate_plan(llama, cluster, cfg, 8, precision=Precision(compute="fp8"))
    assert eager.step_time > fp8.step_time
    # tensor-wise scales of tensor-parallel shards all-reduce their amax; row-wise ones do not
    tp = ParallelConfig(dp=2, tp=4, zero=1)
    tensorwise = price(llama, cluster, tp, 8, precision=Precision(compute="fp8", kernels="compiled"))
    rowwise = price(llama, cluster, tp, 8, precision=Precision(compute="fp8", recipe="rowwise", kernels="compiled"))
    assert tensorwise.breakdown.tp_comm > rowwise.breakdown.tp_comm
    # a row-wise plan is slower than the tensor-wise one (at 1,024-token micro-batches, slower than bf16's too)
    row = estimate_plan(llama, cluster, cfg, 8, precision=Precision(compute="fp8", recipe="rowwise",
                                                                    kernels="compiled"))
    assert row.step_time > fp8.step_time


def gpt_tiny(device="cpu"):
    """The standalone test's model factory (callable with no arguments, as train.py calls it)."""
    return build("gpt-tiny", batch_size=1, device=device)[0]


def test_the_standalone_folder_runs_fp8_linear_layers(tmp_path):
    """An fp8 plan's standalone folder calls its linear layers through the runtime library's torchao float8
    module (runtime/fp8.py, copied beside it), built by train.py for the plan's recipe; the fp32 plan's layers
    call none (tests/distributed/test_standalone.py trains one against one process converted alike)."""
    model, inputs = build("gpt-tiny", batch_size=1)
    cluster = autopar.Cluster.from_spec("1x2xH100-SXM")
    from autopar.codegen.standalone import emit_standalone
    texts = {}
    for compute in ("fp8", "fp32"):   # the fp32 model as it is, or its linear layers in fp8 (the rest in fp32)
        plan = autopar.estimate(model, cluster, inputs, ParallelConfig(dp=2), global_batch_size=2,
                                precision=Precision(compute=compute, **({"fp8_storage": "fp32"} if compute == "fp8"
                                                                       else {})))
        emit_standalone(plan, str(tmp_path / compute), "test_low_precision:gpt_tiny", None, None, 1e-3)
        texts[compute] = (tmp_path / compute / "program.py").read_text()
    assert "FP8_RECIPE = 'tensorwise'" in texts["fp8"] and "FP8_RECIPE = None" in texts["fp32"]
    linears = texts["fp8"].count("self.fp8_linear(")
    assert linears >= 4 and "self.fp8_linear = fp8" in texts["fp8"]   # the block's 4 linear layers at least
    assert "fp8_linear" not in texts["fp32"]
    assert (tmp_path / "fp8" / "autopar_runtime" / "fp8.py").exists()
