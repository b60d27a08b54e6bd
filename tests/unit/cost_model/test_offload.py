"""Offloading (ParallelConfig.offload: the optimizer alone, or ZeRO-3's states whole): priced from the host's
figures, searched when it makes a plan fit, refused where the device describes no host (cost_model/offload.py)."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar import ParallelConfig
from autopar.cost_model.offload import CPU_ADAM_BYTES, HOST_STREAM_EFFICIENCY
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.hardware import Device, Host
from autopar.models import build


@pytest.fixture(scope="module")
def gpt():
    return build("gpt-tiny", batch_size=1)


def _estimate(gpt, cluster, **cfg):
    model, inputs = gpt
    return autopar.estimate(model, cluster, inputs, ParallelConfig(**cfg), global_batch_size=8)


def _with(cluster, **device):
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **device))


def test_offload_prices_the_host_step_and_copies_and_frees_the_device(gpt):
    cluster = autopar.Cluster.from_spec("1x2xH100-SXM")
    kept, moved = _estimate(gpt, cluster, dp=2, zero=3), _estimate(gpt, cluster, dp=2, zero=3, offload="all")
    host = cluster.device.host
    local = kept.stages[0].param_count / 2
    assert moved.breakdown.optimizer == pytest.approx(local * CPU_ADAM_BYTES / (host.memory_bandwidth * HOST_STREAM_EFFICIENCY))
    assert moved.breakdown.optimizer > 10 * kept.breakdown.optimizer   # the CPU streams far slower than HBM
    assert moved.breakdown.dp_comm > kept.breakdown.dp_comm            # every shard crosses PCIe
    assert moved.breakdown.compute == kept.breakdown.compute
    states = kept.stages[0].memory.params + kept.stages[0].memory.grads + kept.stages[0].memory.optimizer
    assert moved.peak_memory == pytest.approx(kept.peak_memory - states)
    assert any("host memory" in n for n in moved.notes) and moved.config.offload == "all"
    assert "offload=all" in moved.config.short()


def test_host_memory_overflow_does_not_fit(gpt):
    cluster = autopar.Cluster.from_spec("1x2xH100-SXM")
    tiny = _with(cluster, host=dataclasses.replace(cluster.device.host, memory=1e3))
    assert not _estimate(gpt, tiny, dp=2, zero=3, offload="all").fits


def test_the_search_offloads_when_only_that_fits(gpt):
    """Device memory between the two peaks (the leanest plan that keeps any states on the device: ZeRO-2 with the
    optimizer offloaded and full recomputation; and ZeRO-3 offloaded whole): only the states offloaded whole fit;
    with room, nothing offloads."""
    model, inputs = gpt
    cluster = autopar.Cluster.from_spec("1x2xH100-SXM")
    fixed = {"dp": 2, "micro_batch_size": 4}   # the rest free
    kept = _estimate(gpt, cluster, zero=2, offload="optimizer", recompute="full", **fixed)
    moved = _estimate(gpt, cluster, zero=3, offload="all", recompute="full", **fixed)
    tight = _with(cluster, memory=(kept.peak_memory + moved.peak_memory) / 2)
    chosen = autopar.plan(model, tight, inputs, global_batch_size=8, fixed=fixed)
    assert chosen.fits and chosen.config.offload == "all" and chosen.config.zero == 3
    assert autopar.plan(model, cluster, inputs, global_batch_size=8, fixed=fixed).config.offload == "none"
    no_host = _with(tight, host=None)   # nowhere to offload to: nothing fits
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(model, no_host, inputs, global_batch_size=8, fixed=fixed)


def test_offload_needs_zero3_and_a_host(gpt):
    with pytest.raises(ConfigError, match="needs zero=3"):
        ParallelConfig(dp=2, zero=2, offload="all")
    with pytest.raises(ConfigError, match='"optimizer" the optimizer.s states alone'):
        ParallelConfig(dp=2, zero=3, offload=True)   # the old bool: the error names the modes
    # a plan file written when offload was a bool reads as the same mode
    assert ParallelConfig.from_dict({"dp": 2, "zero": 3, "offload": True}).offload == "all"
    assert ParallelConfig.from_dict({"dp": 2, "offload": False}).offload == "none"
    cluster = _with(autopar.Cluster.from_spec("1x2xH100-SXM"), host=None)
    with pytest.raises(ConfigError, match="describes no host"):
        _estimate(gpt, cluster, dp=2, zero=3, offload="all")


def test_host_round_trips_and_presets_describe_theirs():
    device = autopar.Cluster.from_spec("1x8xB200").device
    assert Device.from_dict(device.to_dict()) == device and device.host is not None
    assert Host.from_dict(device.host.to_dict()) == device.host
    gb200 = autopar.Cluster.from_spec("1x72xGB200").device.host
    assert gb200.link_bandwidth > 3 * device.host.link_bandwidth   # NVLink-C2C against PCIe 5.0
    with pytest.raises(ConfigError):
        Host(memory=-1.0, memory_bandwidth=1e9, link_bandwidth=1e9, source="")


def test_a_host_overflow_is_no_alternative_with_infinite_memory(gpt):
    """An offloading candidate whose states overflow the host's memory needs no more device memory (search.evaluate
    gives it an infinite need): the alternatives leave it out, where it made a plan whose file could not be read
    back (``autopar sweep`` failed on llama3-70b), and keep the unfit candidates that say how much they need."""
    from types import SimpleNamespace

    from autopar.plan import Plan
    from autopar.solver.choice import alternatives, with_search_results

    best = _estimate(gpt, autopar.Cluster.from_spec("1x2xH100-SXM"), dp=2, zero=3)

    def candidate(cfg):
        return SimpleNamespace(config=lambda: cfg, sort_key=lambda: cfg.short())
    host_full = candidate(ParallelConfig(dp=2, zero=3, offload="all"))
    too_big = candidate(ParallelConfig(dp=2, zero=1))
    seen = [(best.step_time, None, best), (best.step_time * 0.8, host_full, float("inf")),
            (best.step_time * 0.9, too_big, 2 * best.cluster.device.memory)]
    alts = alternatives(best, seen, best.cluster.device.memory, 0.0)
    assert [a.config for a in alts] == [too_big.config()] and "GB more per device" in alts[0].reason
    stats = SimpleNamespace(timed_out=False, ilp_stopped_early=0, gap=None, ilp_fallbacks=(), counts=lambda: {})
    chosen = with_search_results(best, stats, alts, (), "even", seen, 0.0)
    assert Plan.from_dict(chosen.to_dict()).alternatives == chosen.alternatives


def test_optimizer_offload_prices_the_round_trip_and_the_host_step(gpt):
    """offload="optimizer": the device keeps its weights and gradients, the states go to the host; the step
    is the CPU's, after the gradients' copy to the host and before the weights' copy back (offload.py)."""
    model, _ = gpt
    cluster = autopar.Cluster.from_spec("1x2xH100-SXM")
    device, host = cluster.device, cluster.device.host
    kept, moved = (_estimate(gpt, cluster, dp=2, zero=1, offload=mode) for mode in ("none", "optimizer"))
    local = kept.stages[0].param_count / 2   # ZeRO-1: the optimizer steps half
    tensors = len(list(model.parameters())) / 2   # ZeRO-1 partitions whole tensors
    p = moved.precision
    expected = (local * CPU_ADAM_BYTES / (host.memory_bandwidth * HOST_STREAM_EFFICIENCY)
                + local * (p.grad_bytes + p.weight_bytes) / host.link_bandwidth
                + 2 * tensors * device.dispatch_overhead) * device.concurrency_slowdown
    assert moved.breakdown.optimizer == pytest.approx(expected)
    assert moved.breakdown.dp_comm == kept.breakdown.dp_comm and moved.breakdown.compute == kept.breakdown.compute
    a, b = kept.stages[0].memory, moved.stages[0].memory
    assert (b.params, b.grads, b.optimizer) == (a.params, a.grads, 0.0)
    assert moved.peak_memory == pytest.approx(kept.peak_memory - a.optimizer)
    # on the host: the fp32 master, its fp32 gradient and Adam's two moments of the shard it steps
    assert any(f"{local * 16 / 1e9:.1f} GB of optimizer states" in n for n in moved.notes)
    assert "offload=optimizer" in moved.config.short()
    tiny = _with(cluster, host=dataclasses.replace(host, memory=local * 15))
    assert not _estimate(gpt, tiny, dp=2, zero=1, offload="optimizer").fits


def test_the_search_offloads_the_optimizer_when_only_that_fits(gpt):
    """Device memory under the leanest plan that offloads nothing (ZeRO-2 with full recomputation) but over the
    optimizer-offloaded ZeRO-2 without recomputation: the search offloads the optimizer alone (offloading
    ZeRO-3's states whole fits too, but is no simpler nor faster)."""
    model, inputs = gpt
    cluster = autopar.Cluster.from_spec("1x2xH100-SXM")
    fixed = {"dp": 2, "micro_batch_size": 4}
    leanest = _estimate(gpt, cluster, zero=2, recompute="full", **fixed)
    moved = _estimate(gpt, cluster, zero=2, offload="optimizer", **fixed)
    assert moved.peak_memory < leanest.peak_memory
    tight = _with(cluster, memory=(leanest.peak_memory + moved.peak_memory) / 2)
    chosen = autopar.plan(model, tight, inputs, global_batch_size=8, fixed=fixed)
    assert chosen.fits and chosen.config.offload == "optimizer" and chosen.peak_memory <= tight.device.memory
    assert chosen.step_time <= moved.step_time
    line = next(l for l in chosen.explain().splitlines() if "offload optimizer:" in l)   # explain says what moved
    assert "host memory" in line and "GB of optimizer states" in line and "the optimizer step takes" in line
    with pytest.raises(InfeasiblePlanError):   # with nothing offloaded, nothing fits
        autopar.plan(model, tight, inputs, global_batch_size=8, fixed={**fixed, "offload": "none"})


def test_host_bytes_count_the_weights_gradients_and_moments_in_the_dtype_stepped():
    """Both modes keep, per parameter stepped, the weight and its gradient in the dtype the optimizer steps and
    the moments: 16 bytes under bf16 with fp32 masters and under fp32 alike (fp32 training keeps no master beside
    its weights: nothing to take off), 12 with bf16 weights stepped as they are."""
    from autopar import Precision
    from autopar.cost_model.offload import host_bytes
    for mode in ("optimizer", "all"):
        cfg = ParallelConfig(dp=2, zero=3, offload=mode)
        assert host_bytes(Precision(), cfg, 1.0) == 16.0
        assert host_bytes(Precision(compute="fp32", grads="fp32"), cfg, 1.0) == 16.0
        assert host_bytes(Precision(master_weights=False), cfg, 1.0) == 12.0
    assert host_bytes(Precision(), ParallelConfig(dp=2), 1.0) == 0.0
