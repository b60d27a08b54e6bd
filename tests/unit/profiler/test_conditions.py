"""The conditions a machine profile was measured under (autopar/conditions.py): recorded with the device
profile and read back, a noisy measurement measured again then warned about (or refused), a noisy
cache warned about, ``--refresh`` replacing the cache, an older cache format measured again.

Nothing here is timed: the device profile runs with its timing source (``call_times`` and the first
untimed call's ``_one_call``) and its load source (``host._snapshot``, ``host._load_average``) replaced
by made-up figures, and the kernels are not even called.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import replace
from types import MappingProxyType

import pytest
import torch

import autopar.profiler.device as dev
import autopar.profiler.host as host
import autopar.profiler.local as local
from autopar import Cluster, ConfigError, NoisyProfileError, NoisyProfileWarning
from autopar.cli import main
from autopar.conditions import MAX_ATTEMPTS, SPREAD_LIMIT, ProfileConditions
from autopar.profiler.database import ProfileDB
from autopar.profiler.device import measure_device
from autopar.profiler.device_profile import RECORD_KEY, load_profile, save_profile
from autopar.profiler.host import device_name

CPU = torch.device("cpu")
NAME = device_name(CPU, 1)


class Machine:
    """Made-up timings and loads: each measurement's repeats spread by the next of ``spreads``, while other
    processes keep ``other`` cores busy and the measurement waits ``wait`` of its time for a core."""

    def __init__(self, monkeypatch, spreads=(0.1,), other=0.05, wait=0.002) -> None:
        self.spreads, self.other, self.wait = list(spreads), other, wait
        self.measurements, self.snapshots = 0, 0
        monkeypatch.setattr(dev, "call_times", self.call_times)
        monkeypatch.setattr(dev, "_one_call", lambda fn, device: 1e-4)
        monkeypatch.setattr(host, "_snapshot", self.snapshot)
        monkeypatch.setattr(host, "_load_average", lambda: 0.25)
        tiny = replace(dev.BUDGETS[("cpu", "quick")], stream_bytes=1 << 20)    # no time allocating what is not run
        monkeypatch.setattr(dev, "BUDGETS", MappingProxyType({**dev.BUDGETS, ("cpu", "quick"): tiny}))

    def call_times(self, fn, device, *, warmup=2, repeats=5):
        spread = self.spreads[min(self.measurements - 1, len(self.spreads) - 1)]
        return [1e-4 * (1 + spread * (i / (repeats - 1) - 0.5)) for i in range(repeats)] if repeats > 1 else [1e-4]

    def snapshot(self):
        """10 s of wall time per measurement; it keeps one core busy, the others ``other`` cores."""
        if self.snapshots % 2 == 0:
            self.measurements += 1
        self.snapshots += 1
        t = 10.0 * self.snapshots
        return t, t * (1 + self.other), t, {"1": (t * (1 - self.wait), t * self.wait)}

    def measure(self, device, threads, progress=True):
        return measure_device(device, threads, dtypes=("fp32",), budget="quick", progress=False)


def test_measure_device_records_its_conditions_and_the_cache_reads_them_back(monkeypatch, tmp_path) -> None:
    machine = Machine(monkeypatch, spreads=(0.1,), other=0.3, wait=0.01)
    profile = machine.measure(CPU, 1)
    c = profile.conditions
    assert (c.part, c.threads, c.cores, c.torch_version, c.attempts) == ("device", 1, os.cpu_count(),
                                                                         torch.__version__, 1)
    assert c.other_load == pytest.approx(0.3) and c.own_load == pytest.approx(1.0)
    assert c.wait_fraction == pytest.approx(0.01) and c.load_average == 0.25
    assert c.spread == pytest.approx(0.1)        # (max - min) / median of every kernel's repeats
    assert not c.noisy and "clean" in c.describe()
    db = ProfileDB(tmp_path / "profile.json")
    save_profile(db, profile)
    db.save()
    record = json.loads((tmp_path / "profile.json").read_text())
    stored = next(iter(record["machines"].values()))["device"][RECORD_KEY]["conditions"]
    assert stored["other_load"] == pytest.approx(0.3) and stored["spread"] == pytest.approx(0.1)
    assert load_profile(ProfileDB(tmp_path / "profile.json"), NAME) == profile


def test_noisy_repeats_are_measured_again_and_a_clean_one_is_kept(monkeypatch, tmp_path) -> None:
    machine = Machine(monkeypatch, spreads=(2 * SPREAD_LIMIT, 0.1))
    monkeypatch.setattr(local, "measure_device", machine.measure)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoisyProfileWarning)
        cluster = Cluster.local(nprocs=1, threads_per_rank=1, profile_db=str(tmp_path / "p.json"), progress=False)
    assert machine.measurements == 2
    (conditions,) = cluster.profile_conditions
    assert conditions.attempts == 2 and conditions.spread == pytest.approx(0.1) and cluster.profile_warning is None


def test_a_measurement_noisy_every_time_warns_and_the_plan_says_so(monkeypatch, tmp_path) -> None:
    machine = Machine(monkeypatch, spreads=(3 * SPREAD_LIMIT, 2 * SPREAD_LIMIT, 4 * SPREAD_LIMIT))
    monkeypatch.setattr(local, "measure_device", machine.measure)
    db = str(tmp_path / "p.json")
    with pytest.warns(NoisyProfileWarning, match="autopar profile --refresh"):
        cluster = Cluster.local(nprocs=1, threads_per_rank=1, profile_db=db, progress=False)
    assert machine.measurements == MAX_ATTEMPTS
    (conditions,) = cluster.profile_conditions
    assert conditions.attempts == MAX_ATTEMPTS and conditions.spread == pytest.approx(2 * SPREAD_LIMIT)  # least noisy
    assert "repeats spread" in cluster.profile_warning and "--refresh" in cluster.profile_warning
    # cached as it is, and loading it warns again without measuring
    with pytest.warns(NoisyProfileWarning, match="cached device profile"):
        again = Cluster.local(nprocs=1, threads_per_rank=1, profile_db=db, progress=False)
    assert machine.measurements == MAX_ATTEMPTS and again == cluster
    with pytest.raises(NoisyProfileError, match="--refresh"):
        Cluster.local(nprocs=1, threads_per_rank=1, profile_db=db, strict=True, progress=False)


def test_strict_refuses_a_machine_busy_every_time_and_caches_nothing(monkeypatch, tmp_path) -> None:
    machine = Machine(monkeypatch, other=1.5, wait=0.4)     # other processes hold more cores than it used
    monkeypatch.setattr(local, "measure_device", machine.measure)
    db = tmp_path / "p.json"
    with pytest.raises(NoisyProfileError, match="other processes kept 1.50 cores busy"):
        Cluster.local(nprocs=1, threads_per_rank=1, profile_db=str(db), strict=True, progress=False)
    assert machine.measurements == MAX_ATTEMPTS and not db.exists()


def test_refresh_replaces_the_cache_and_profile_shows_its_conditions(monkeypatch, tmp_path, capsys) -> None:
    machine = Machine(monkeypatch, other=1.5, wait=0.4)
    monkeypatch.setattr(local, "measure_device", machine.measure)
    db = str(tmp_path / "p.json")
    assert main(["profile", "--nprocs", "1", "--threads-per-rank", "1", "--db", db]) == 0
    text = capsys.readouterr().out
    assert "device: measured" in text and " ago)" in text and "NOISY" in text and "warning:" in text
    assert main(["profile", "--nprocs", "1", "--threads-per-rank", "1", "--db", db, "--strict"]) == 2
    assert "--refresh" in capsys.readouterr().err
    machine.other, machine.wait = 0.05, 0.002      # the machine is idle now
    assert main(["profile", "--nprocs", "1", "--threads-per-rank", "1", "--db", db, "--refresh", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (conditions,) = out["conditions"]
    assert conditions["noise"] == [] and conditions["other_load"] == pytest.approx(0.05)
    assert conditions["age_seconds"] >= 0 and out["cluster"]["profile_conditions"][0]["attempts"] == 1
    assert machine.measurements == MAX_ATTEMPTS + 1
    stored = load_profile(ProfileDB(db), NAME).conditions
    assert not stored.noisy and stored.other_load == pytest.approx(0.05)    # replaced in the cache
    assert main(["profile", "--nprocs", "1", "--threads-per-rank", "1", "--db", db]) == 0
    assert "clean" in capsys.readouterr().out and machine.measurements == MAX_ATTEMPTS + 1


def test_a_cache_of_the_older_format_without_conditions_is_measured_again(monkeypatch, tmp_path) -> None:
    machine = Machine(monkeypatch)
    monkeypatch.setattr(local, "measure_device", machine.measure)
    db = tmp_path / "p.json"
    Cluster.local(nprocs=1, threads_per_rank=1, profile_db=str(db), progress=False)
    data = json.loads(db.read_text())
    for record in (m["device"][RECORD_KEY] for m in data["machines"].values()):
        conditions = record.pop("conditions")       # format 1: the date and torch version, no conditions
        record |= {"format": 1, "measured_at": conditions["measured_at"], "torch_version": conditions["torch_version"]}
    db.write_text(json.dumps(data))
    assert load_profile(ProfileDB(db), NAME) is None
    cluster = Cluster.local(nprocs=1, threads_per_rank=1, profile_db=str(db), progress=False)
    assert machine.measurements == 2 and cluster.profile_conditions[0].part == "device"
    assert load_profile(ProfileDB(db), NAME).conditions == cluster.profile_conditions[0]


def test_conditions_validate_and_round_trip() -> None:
    c = ProfileConditions(part="links gloo x2", device_type="cpu",
                          measured_at="2026-01-02T03:04:05+00:00", torch_version="2.13.0",
                          threads=2, cores=2, load_average=None, other_load=0.1, own_load=1.8, wait_fraction=None,
                          spread=None)
    assert ProfileConditions.from_dict(json.loads(json.dumps(c.to_dict()))) == c and not c.noisy
    busy = replace(c, other_load=6.0)      # other processes' CPU load counts against a CPU measurement only
    assert busy.noisy and not replace(busy, device_type="cuda").noisy
    assert replace(busy, device_type="cuda", wait_fraction=0.2).noisy
    with pytest.raises(ConfigError, match="other_load"):
        ProfileConditions.from_dict(c.to_dict() | {"other_load": -1.0})
    with pytest.raises(ConfigError, match="format"):
        ProfileConditions.from_dict({k: v for k, v in c.to_dict().items() if k != "format"})
    with pytest.raises(ConfigError, match="missing"):
        ProfileConditions.from_dict({k: v for k, v in c.to_dict().items() if k != "spread"})
    # a links measurement with a flat fit: noisy past any other, round-trips, and older records read as none
    flat = replace(c, flat=("all_to_all",))
    assert flat.noisy and flat.severity() == math.inf and "all_to_all time did not grow" in flat.describe()
    assert ProfileConditions.from_dict(json.loads(json.dumps(flat.to_dict()))) == flat
    assert ProfileConditions.from_dict({k: v for k, v in c.to_dict().items() if k != "flat"}).flat == ()
    with pytest.raises(ConfigError, match="flat"):
        replace(c, flat=("",))


def test_the_load_meter_reads_other_processes_and_its_own_threads_waits(monkeypatch) -> None:
    """Between two snapshots 10 s apart the machine was busy 15 CPU-s, this process 8 of them; its main
    thread ran 9 s and waited 1 s, a thread started meanwhile (torch's pool) ran 4 s and waited 1 s."""
    snapshots = iter([(100.0, 500.0, 50.0, {"1": (10.0, 2.0)}),
                      (110.0, 515.0, 58.0, {"1": (19.0, 3.0), "2": (4.0, 1.0)})])
    monkeypatch.setattr(host, "_snapshot", lambda: next(snapshots))
    monkeypatch.setattr(host, "_load_average", lambda: 1.5)
    with host.LoadMeter() as load:
        pass
    assert load.own_load == pytest.approx(0.8) and load.other_load == pytest.approx(0.7)
    assert load.wait_fraction == pytest.approx(2 / 15) and load.load_average == 1.5
