"""Op profiling: deduplicated timings, the cache, shard scaling, and the profile=True entry points."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar import Cluster, ConfigError, ParallelConfig
from autopar.capture import OpKind, capture
from autopar.presets import device_preset
from autopar.models import GPTConfig, build_gpt
from autopar.profiler.database import ProfileDB
from autopar.profiler.host import device_name
from autopar.profiler.ops import OpProfiler, OpTiming, signature, tile_inputs

CFG = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=2, seq_len=16, dropout=0.0)
TEST_DEVICE = "cpu test-device x1 thread"   # the ProfileDB key of _profiler's device


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model, inputs = build_gpt(CFG, batch_size=1)
    return model, inputs, capture(model, inputs)


def _profiler(gpt, path, **kw) -> OpProfiler:
    model, inputs, graph = gpt
    return OpProfiler(model, inputs, graph, TEST_DEVICE, ProfileDB(path), threads=1, warmup=1,
                      repeats=2, progress=False, **kw)


def _local_cluster(devices: int = 2) -> Cluster:
    """A cluster whose device carries this machine's profiler name (what Cluster.local returns), with the
    preset CPU constants: profile=True accepts it without measuring the device and links."""
    base = Cluster.from_spec(f"1x{devices}xcpu")
    device = dataclasses.replace(device_preset("cpu"), name=device_name(torch.device("cpu"), 1), threads=1)
    return dataclasses.replace(base, device=device)


def test_tile_inputs_repeats_rows_of_batched_tensors_only() -> None:
    x = {"ids": torch.tensor([[1, 2, 3]]), "table": torch.arange(4)}
    out = tile_inputs(x, 1, 3)
    assert out["ids"].tolist() == [[1, 2, 3]] * 3
    assert out["table"].tolist() == [0, 1, 2, 3]  # dim 0 is not the batch: left alone
    two = (torch.tensor([[1.0], [2.0]]),)
    assert tile_inputs(two, 2, 5)[0].flatten().tolist() == [1.0, 2.0, 1.0, 2.0, 1.0]
    assert tile_inputs(two[0], 2, 1).flatten().tolist() == [1.0]


def test_signature_tells_shapes_dtypes_and_gradients_apart() -> None:
    a, b = torch.ones(2, 3), torch.ones(2, 4)
    base = signature(torch.ops.aten.add.Tensor, (a, a), {}, {})
    assert base == signature(torch.ops.aten.add.Tensor, (torch.zeros(2, 3), torch.zeros(2, 3)), {}, {})
    assert base != signature(torch.ops.aten.add.Tensor, (b, b), {}, {})
    assert base != signature(torch.ops.aten.add.Tensor, (a.double(), a.double()), {}, {})
    assert base != signature(torch.ops.aten.add.Tensor, (a, a), {}, {id(a): True})
    assert base != signature(torch.ops.aten.mul.Tensor, (a, a), {}, {})


def test_profile_times_each_distinct_op_once_and_the_cache_makes_a_second_profile_free(gpt, tmp_path) -> None:
    model, _, graph = gpt
    path = tmp_path / "db.json"
    first = _profiler(gpt, path)
    timings = first.timings(2)
    timed_ops = [n for n in graph.nodes if n.kind is not OpKind.VIEW]
    assert set(timings) == {n.name for n in timed_ops} - {n for n in first.untimed}
    assert all(t.fwd_seconds > 0 and t.bwd_seconds >= 0 for t in timings.values())
    grads = [n.name for n in timed_ops if n.requires_grad and n.kind is OpKind.MATMUL]
    assert grads and all(timings[n].bwd_seconds > 0 for n in grads)
    # two identical blocks: the second block's ops are the first's signatures
    assert 0 < first.timed < len(timed_ops)
    assert path.exists()
    second = _profiler(gpt, path)
    assert second.timings(2) == timings
    assert second.timed == 0 and second.reused > 0
    assert "0 op signatures timed" in second.summary()


def test_whole_pass_scales_the_op_times(gpt, tmp_path) -> None:
    prof = _profiler(gpt, tmp_path / "db.json")
    timings = prof.timings(1)
    rf, rb = prof.in_context[1]
    assert rf > 0 and rb > 0
    record = prof.db.get(prof.device_name, "ops", f"pass {prof.graph.content_hash} b1")
    assert record is not None
    assert sum(t.fwd_seconds for t in timings.values()) == pytest.approx(record["fwd_seconds"], rel=1e-9)


def test_lookup_scales_shards_and_refuses_other_dtypes(gpt, tmp_path) -> None:
    _, _, graph = gpt
    prof = _profiler(gpt, tmp_path / "db.json")
    timings = prof.timings(1)
    gelu = next(n for n in graph.nodes if n.kind is OpKind.ELEMENTWISE and n.name in timings and n.batch_dependent)
    t = timings[gelu.name]
    assert prof.lookup(gelu, 1.0, 1, "", "fp32") == (t.fwd_seconds, t.bwd_seconds)
    # the per-op overhead stays whole and the rest is divided; set relative to the measured time, which varies
    prof.kernel_overhead = t.fwd_seconds / 4
    half = prof.lookup(gelu, 1.0, 2, "", "fp32")
    assert half[0] == pytest.approx(t.fwd_seconds / 4 + (t.fwd_seconds * 3 / 4) / 2)
    prof.kernel_overhead = t.fwd_seconds * 2      # an op faster than the overhead costs the overhead, not less
    assert prof.lookup(gelu, 1.0, 2, "", "fp32")[0] == pytest.approx(t.fwd_seconds * 2)
    prof.kernel_overhead = 0.0
    assert prof.lookup(gelu, 1.0, 1, "", "bf16") is None
    view = next(n for n in graph.nodes if n.kind is OpKind.VIEW)
    assert prof.lookup(view, 1.0, 1, "", "fp32") is None
    mm = next(n for n in graph.nodes if n.kind is OpKind.MATMUL and n.gemm is not None and n.gemm.n >= 64)
    full = prof.lookup(mm, 1.0, 1, "", "fp32")
    split = prof.lookup(mm, 1.0, 2, "n", "fp32")
    gemm_full = prof._gemm(dataclasses.replace(mm.gemm))
    gemm_half = prof._gemm(dataclasses.replace(mm.gemm, n=mm.gemm.n // 2))
    assert split[0] == pytest.approx(full[0] * gemm_half.fwd_seconds / gemm_full.fwd_seconds)
    assert isinstance(gemm_full, OpTiming)


def test_profile_true_needs_a_local_cluster_and_real_weights(gpt, tmp_path) -> None:
    model, inputs, _ = gpt
    cfg = ParallelConfig(dp=2, micro_batch_size=1)
    with pytest.raises(ConfigError, match="Cluster.local"):
        autopar.estimate(model, Cluster.from_spec("1x2xcpu"), inputs, cfg, global_batch_size=2, profile=True,
                         profile_db=tmp_path / "db.json")
    meta, meta_inputs = build_gpt(CFG, batch_size=1, device="meta")
    with pytest.raises(ConfigError, match="meta"):
        autopar.estimate(meta, _local_cluster(), meta_inputs, cfg, global_batch_size=2, profile=True,
                         profile_db=tmp_path / "db.json")


def test_estimate_and_plan_with_profile_use_the_measured_times(gpt, tmp_path) -> None:
    model, inputs, _ = gpt
    cluster = _local_cluster()
    db = tmp_path / "db.json"
    cfg = ParallelConfig(dp=2, micro_batch_size=2)
    analytic = autopar.estimate(model, cluster, inputs, cfg, global_batch_size=4)
    measured = autopar.estimate(model, cluster, inputs, cfg, global_batch_size=4, profile=True, profile_db=db)
    assert measured.step_time != analytic.step_time
    assert any(note.startswith("op times measured on") for note in measured.notes)
    best = autopar.plan(model, cluster, inputs, global_batch_size=4, profile=True, profile_db=db)
    assert best.fits and best.step_time > 0
    assert any("op times measured on" in note for note in best.notes)


def test_a_compiled_plan_prices_the_optimizer_step_a_compiled_program_runs(gpt, tmp_path) -> None:
    """A compiled program compiles its optimizer step (runtime/optim.py): profiled, a compiled plan's
    optimizer is priced from the compiled step's own measurement, an eager plan's from the eager one."""
    model, inputs, graph = gpt
    cluster = _local_cluster()
    db = ProfileDB(tmp_path / "db.json")
    for key, seconds in ((f"adamw {graph.content_hash}", 8.0), (f"adamw compiled {graph.content_hash}", 2.0)):
        for device in (cluster.device.name, TEST_DEVICE):   # estimate's profiler's, and _profiler's
            db.put(device, "ops", key, {"step_seconds": seconds, "params": 1000})
    db.save()
    prof = _profiler(gpt, tmp_path / "db.json")
    assert prof.optimizer_seconds_per_param("eager") == pytest.approx(8e-3)
    assert prof.optimizer_seconds_per_param("compiled") == pytest.approx(2e-3)
    cfg = ParallelConfig(dp=2, micro_batch_size=2)
    steps = {kernels: autopar.estimate(model, cluster, inputs, cfg, global_batch_size=4, profile=True,
                                       profile_db=tmp_path / "db.json",
                                       precision=autopar.Precision(kernels=kernels)).breakdown.optimizer
             for kernels in ("eager", "compiled")}
    assert steps["eager"] == pytest.approx(4 * steps["compiled"]) and steps["compiled"] > 0
