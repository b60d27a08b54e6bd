"""FSDP2's fp8 all-gather (Precision.gathers_fp8: tensor-wise fp8 at ZeRO 2-3 over replicas, tp = 1): which
weights it gathers in fp8 (the cost model's rule and the compiler's agree), and what it saves: one byte an
element of those weights where bf16 gathers two, plus an amax all-reduce a weight and gather."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import Cluster
from autopar.capture import capture
from autopar.codegen.compile import compile_program
from autopar.config import ParallelConfig, Precision
from autopar.cost_model.estimator import Estimator
from autopar.cost_model.layer_cost import LayerCostModel
from autopar.cost_model.low_precision import gathered_weights
from autopar.models import build

TENSOR = Precision(compute="fp8", recipe="tensorwise")
CLUSTER = Cluster.from_spec("2x8xH100-SXM")


@pytest.fixture(scope="module")
def llama():
    model, inputs = build("llama3-8b", batch_size=1, seq_len=1024, device="meta")
    return capture(model, inputs, progress=False)


def test_which_plans_gather_in_fp8():
    zero3 = ParallelConfig(dp=16, zero=3)
    assert TENSOR.gathers_fp8(zero3) and TENSOR.gathers_fp8(ParallelConfig(dp=16, zero=2))
    assert not TENSOR.gathers_fp8(ParallelConfig(dp=16, zero=1))            # nothing gathered per step
    assert not TENSOR.gathers_fp8(ParallelConfig(dp=8, tp=2, zero=3))       # a tensor-parallel shard's: not run
    assert not TENSOR.gathers_fp8(ParallelConfig(pp=16, zero=3))            # one replica: nothing to gather
    assert not Precision(compute="fp8", recipe="rowwise").gathers_fp8(zero3)   # cast after the gather
    assert not Precision().gathers_fp8(zero3)


def test_the_weights_read_by_fp8_linears_alone(llama):
    """Every block's seven projection weights; not the head's when tied (none here: Llama 3's is its own), not
    a norm's, not the embedding."""
    weights = gathered_weights(llama)
    assert len(weights) == 32 * 7 + 1 and all(w.endswith(".weight") for w in weights)
    assert "model.embed_tokens.weight" not in weights and not any("norm" in w for w in weights)


def test_the_compiler_gathers_the_weights_the_cost_model_prices():
    """codegen's CompiledProgram.fp8_gathered (on the exported graph) is low_precision.gathered_weights (on the
    captured one): for autopar's GPT, every block's four linear weights, not its head, tied to the embedding
    (read by the embedding too: gathered as held)."""
    import autopar
    from autopar.capture.export import run_export
    from autopar.models import GPTConfig, build_gpt
    cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2)
    model, example = build_gpt(cfg, batch_size=1, device="meta")
    plan = autopar.plan(model, Cluster.from_spec("1x2xcpu"), example, global_batch_size=4,
                        fixed=dict(dp=2, tp=1, pp=1, zero=3, micro_batch_size=2), verbose=False)
    # this CPU has no fp8 peak to price it with; the model is fp32
    plan = dataclasses.replace(plan, precision=Precision(compute="fp8", recipe="tensorwise", fp8_storage="fp32"))
    _, inputs = build_gpt(cfg, batch_size=2, device="meta")
    compiled = compile_program(plan, run_export(model, inputs, None), model)
    graph = capture(*build_gpt(cfg, batch_size=1, device="meta"), progress=False)
    assert compiled.fp8_gathered == gathered_weights(graph)
    assert len(compiled.fp8_gathered) == 2 * 4 and not any("wte" in w or "head" in w for w in compiled.fp8_gathered)
    assert not dataclasses.replace(plan, precision=Precision(compute="fp8", recipe="rowwise")) \
        .precision.gathers_fp8(plan.config)


def test_fp8_gathers_move_half_the_bytes_of_those_weights_plus_their_amax(llama):
    """ZeRO-3 at dp = 16 over two nodes: the device's exposed data-parallel time with its fp8-gathered weights
    (the gathered weights: all but the embedding and the norms) is below the same device's with bf16 gathers;
    the step's one amax all-reduce alone (the weights' count, none of their bytes at one byte) adds to it; and
    a plan that does not gather in fp8 (row-wise) prices its gathers as before."""
    cfg = ParallelConfig(dp=16, zero=3, micro_batch_size=1)
    est = Estimator(llama, CLUSTER, TENSOR, LayerCostModel(llama, CLUSTER, TENSOR))
    weights = gathered_weights(llama)
    share = sum(llama.params[w].numel for w in weights) / llama.param_numel
    assert 0.8 < share < 1.0
    groups = est.placements(cfg)
    dev = est.devices(cfg, 4)[0]
    chunks = [est.shard_units(c, cfg) for c in dev.chunks]
    kept = [u for c in chunks for u in c.kept]
    args = (cfg, 4, groups, dev.params, dev.fwd, dev.bwd, dev.recompute, dev.tp_comm, dev.tp_grad_bytes,
            sum(len(c.units) for c in chunks), dev.expert_params, sum(est._layer_params(i, cfg) for u in kept for i in u),
            len(kept))
    lead = float(est.lead_params(cfg)[dev.chunks[0][0]])   # the device's last gradient (test_last_bucket.py)
    with_fp8, bf16 = est.dp_exposed(cfg, dev, 4, groups), float(est.tail.dp_time(*args, lead=lead))
    assert with_fp8 < bf16
    # what dp_exposed passes: every gathered weight the device holds (one device: all), and those of the kept units
    in_kept = [w for w in weights if any(w in llama.layers[i].params for u in kept for i in u)]
    fp8 = (sum(llama.params[w].numel for w in weights), len(weights),
           sum(llama.params[w].numel for w in in_kept), len(in_kept))
    assert with_fp8 == pytest.approx(float(est.tail.dp_time(*args, fp8, lead)), rel=1e-12)
    bytes_only = float(est.tail.dp_time(*args, (fp8[0], 0, fp8[2], 0), lead))   # the gathers at one byte, no amax
    assert bytes_only < with_fp8 < bf16
    assert float(est.tail.dp_time(*args, (0, len(weights), 0, 0), lead)) > bf16   # the amax all-reduce alone adds
    rowwise = Precision(compute="fp8", recipe="rowwise")
    est_r = Estimator(llama, CLUSTER, rowwise, LayerCostModel(llama, CLUSTER, rowwise))
    dev_r = est_r.devices(cfg, 4)[0]
    assert est_r.dp_exposed(cfg, dev_r, 4, groups) == pytest.approx(float(est_r.tail.dp_time(
        cfg, 4, groups, dev_r.params, dev_r.fwd, dev_r.bwd, dev_r.recompute, dev_r.tp_comm, dev_r.tp_grad_bytes,
        *args[9:], lead=lead)), rel=1e-12)
