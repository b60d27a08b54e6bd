"""Cluster.local: measured device and links become a Cluster, cached; the `autopar profile` command."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import autopar.profiler.local as local
from autopar import Cluster, ConfigError, NoisyProfileError
from autopar.conditions import MAX_ATTEMPTS
from autopar.cli import main
from autopar.cost_model.comm import Collective, GroupPlacement, collective_time
from autopar.profiler.device import measure_device
from autopar.profiler.host import device_name
from autopar.conditions import ProfileConditions
from autopar.profiler.links import COLLECTIVES, LinkProfile, fit_profile

SIZES = (4096, 65536, 1 << 20, 1 << 22)


def idle(part: str, threads: int = 1, **changes) -> ProfileConditions:
    """Conditions of a measurement on an idle machine (``changes`` make them noisy)."""
    return replace(ProfileConditions(part=part, device_type="cpu",
                                     measured_at="2026-01-02T03:04:05+00:00", torch_version=torch.__version__,
                                     threads=threads, cores=2, load_average=0.1, other_load=0.05, own_load=1.0,
                                     wait_fraction=0.002, spread=None if part.startswith("links") else 0.1), **changes)


def _synthetic_links(nprocs: int, threads: int, **_) -> LinkProfile:
    """Links of a made-up machine: t = 50 us + S / 2 GB/s for every collective (p2p twice as fast)."""
    samples = {kind: tuple((s, 5e-5 + s / (4e9 if kind == "p2p" else 2e9)) for s in SIZES) for kind in COLLECTIVES}
    return LinkProfile(backend="gloo", nprocs=nprocs, threads_per_rank=threads, samples=samples,
                       dispatch_fwd_seconds=2e-5, dispatch_bwd_seconds=3e-5, overlap_fraction=0.25,
                       context_seconds={"all_reduce": 2e-3, "p2p": 1e-3}, concurrency_slowdown=1.25,
                       dtensor_step_seconds=1.5e-4, conditions=idle(f"links gloo x{nprocs}", nprocs * threads))


@pytest.fixture()
def measured(monkeypatch):
    """Patch the measurements: a quick real device profile (its conditions an idle machine's, whatever the load
    of this one), synthetic links; count the calls."""
    calls = {"device": 0, "links": 0}

    def device(dev, threads, progress=True):
        calls["device"] += 1
        profile = measure_device(dev, threads, dtypes=("fp32",), budget="quick", progress=False)
        return replace(profile, conditions=idle("device", threads))

    def links(nprocs, threads, **kw):
        calls["links"] += 1
        return _synthetic_links(nprocs, threads)

    monkeypatch.setattr(local, "measure_device", device)
    monkeypatch.setattr(local, "measure_links", links)
    return calls


def test_local_cluster_is_this_machine_measured_and_cached(measured, tmp_path) -> None:
    db = tmp_path / "profile.json"
    cluster = Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(db), progress=False)
    assert measured == {"device": 1, "links": 1}
    assert (cluster.nodes, cluster.devices_per_node) == (1, 2)
    assert cluster.device.name == device_name(torch.device("cpu"), 1) and cluster.device.threads == 1
    assert cluster.device.dispatch_overhead == pytest.approx(2e-5)
    assert cluster.device.dispatch_overhead_backward == pytest.approx(3e-5)
    assert cluster.device.concurrency_slowdown == 1.25 and cluster.device.dtensor_step_overhead == 1.5e-4
    assert cluster.intra_node.overlap == 0.25
    assert set(cluster.intra_node.collectives) == set(COLLECTIVES)
    assert "not measured" in cluster.inter_node.name
    # the comm model prices the measured line, alpha + S * beta at n = 2 ranks, plus the in-context latency
    assert (cluster.intra_node.context_latency, cluster.intra_node.context_latency_p2p) == (2e-3, 1e-3)
    group = GroupPlacement(size=2, ranks_per_node=2, groups_per_node=1)
    fits = fit_profile(_synthetic_links(2, 1))
    for kind in ("all_reduce", "all_gather"):
        assert collective_time(Collective(kind), 1 << 21, group, cluster) == pytest.approx(
            float(fits[kind].predict(1 << 21)) + 2e-3, rel=1e-6)
    assert collective_time(Collective.P2P, 1 << 21, group, cluster) == pytest.approx(
        float(fits["p2p"].predict(1 << 21)) + 1e-3, rel=1e-6)
    again = Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(db), progress=False)
    assert measured == {"device": 1, "links": 1}  # loaded, not measured
    assert again == cluster
    Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(db), refresh=True, progress=False)
    assert measured == {"device": 2, "links": 2}


def test_one_rank_has_no_links_to_measure(measured, tmp_path) -> None:
    cluster = Cluster.local(nprocs=1, threads_per_rank=1, profile_db=str(tmp_path / "p.json"), progress=False)
    assert cluster.devices == 1 and measured["links"] == 0
    assert cluster.device.dispatch_overhead == 0.0


@pytest.mark.parametrize("kw", [dict(nprocs=0), dict(nprocs=2, threads_per_rank=0), dict(nprocs=True)])
def test_bad_rank_counts_are_refused(kw, tmp_path) -> None:
    with pytest.raises(ConfigError):
        Cluster.local(profile_db=str(tmp_path / "p.json"), progress=False, **kw)


def test_profile_command_prints_the_cached_measurement(measured, tmp_path, capsys) -> None:
    db = str(tmp_path / "profile.json")
    assert main(["profile", "--nprocs", "2", "--threads-per-rank", "1", "--db", db, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["devices_per_node"] == 2 and out["profile_db"] == db
    assert set(out["link_fits"]) == set(COLLECTIVES)
    assert main(["profile", "--nprocs", "2", "--threads-per-rank", "1", "--db", db]) == 0
    text = capsys.readouterr().out
    assert "all_reduce" in text and "peak GFLOP/s" in text
    assert measured == {"device": 1, "links": 1}
    assert main(["profile", "--nprocs", "0", "--db", db]) == 2
    assert "nprocs" in capsys.readouterr().err


def test_a_link_record_of_an_older_autopar_is_measured_again(measured, tmp_path) -> None:
    """A cached link profile without a field this autopar measures (concurrency_slowdown) is a miss."""
    db = tmp_path / "profile.json"
    Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(db), progress=False)
    data = json.loads(db.read_text())
    for device in data["machines"].values():
        for record in device.get("links", {}).values():
            del record["concurrency_slowdown"]
    db.write_text(json.dumps(data))
    cluster = Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(db), progress=False)
    assert measured["links"] == 2 and cluster.device.concurrency_slowdown == 1.25



def test_a_flat_link_fit_is_measured_again_and_the_priceable_one_kept(monkeypatch, tmp_path) -> None:
    """A measurement whose all-to-all came out flat (stalls on the small messages, as CI's load made one) is
    noisy past any other: Cluster.local measures again and keeps the one it can price; flat every time, it is
    refused and not cached, with the advice to measure again on an idle machine."""
    flat = {"all_to_all": tuple((s, 1.4e-3) for s in SIZES)}
    attempts = []

    def links(nprocs, threads, flat_first=1, **kw):
        attempts.append(None)
        profile = _synthetic_links(nprocs, threads)
        if len(attempts) <= flat_first:
            profile = replace(profile, samples={**profile.samples, **flat},
                              conditions=replace(profile.conditions, flat=("all_to_all",)))
        return profile

    monkeypatch.setattr(local, "measure_device", lambda dev, threads, progress=True: replace(
        measure_device(dev, threads, dtypes=("fp32",), budget="quick", progress=False),
        conditions=idle("device", threads)))
    monkeypatch.setattr(local, "measure_links", links)
    cluster = Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(tmp_path / "a.json"), progress=False)
    assert len(attempts) == 2 and cluster.profile_conditions[1].attempts == 2
    assert cluster.profile_conditions[1].flat == () and cluster.profile_warning is None
    assert cluster.intra_node.collectives["all_to_all"].bandwidth > 0
    attempts.clear()
    monkeypatch.setattr(local, "measure_links", lambda n, t, **kw: links(n, t, flat_first=99))
    db = tmp_path / "b.json"
    with pytest.raises(NoisyProfileError, match="all_to_all time did not grow.*cannot be priced with.*--refresh"):
        Cluster.local(nprocs=2, threads_per_rank=1, profile_db=str(db), progress=False)
    assert len(attempts) == MAX_ATTEMPTS and not db.exists()      # nothing cached
