"""``Cluster.local()``: this machine as a Cluster of measured devices and links, cached in a ProfileDB.

Ranks: on a GPU machine one per GPU (NCCL); on a CPU ``nprocs`` processes of
``threads_per_rank`` torch threads each (gloo), by default as many one-thread ranks as there
are cores. The device comes from device.py (``fit_device`` of its FLOP/s curves; memory per
rank = RAM / ranks on a CPU), its ``dispatch_overhead`` (tensor-parallel host cost, per op),
``dtensor_step_overhead`` (an FSDP2 optimizer step's DTensor cost, per parameter tensor) and the intra-node
link from links.py (per-collective alpha/beta fits). One machine has no inter-node link to
measure: the preset one of the device family stands in, and ``describe()`` says so.

Each measurement records the conditions it ran under (autopar/conditions.py). A noisy one is
taken again, up to ``MAX_ATTEMPTS`` times in all, and the least noisy kept; one still noisy is
cached (it is the best this moment gives) with a ``NoisyProfileWarning``, or refused with
``strict=True`` (``NoisyProfileError``, nothing cached). A noisy one loaded from the cache warns
(or is refused) the same way: ``refresh=True`` (``autopar profile --refresh``) measures again.
A cached record without conditions (an older autopar's) is measured again.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping, TypeVar

import torch

from ..conditions import MAX_ATTEMPTS, REFRESH_ADVICE, ProfileConditions
from ..hardware import Device, Link
from ..presets import DEVICE_PRESETS, link_presets
from ..errors import ConfigError, NoisyProfileError, NoisyProfileWarning
from .database import ProfileDB
from .device import measure_device
from .device_profile import DeviceProfile, load_profile, save_profile
from .device_fit import DeviceFitReport, fit_device
from .host import accelerator, check_threads, device_name
from .link_timing import measure_links
from .links import CollectiveFitResult, LinkProfile, fit_profile, links_key, to_link


def _ranks(device: torch.device, nprocs: int | None, threads: int | None) -> tuple[int, int]:
    """(ranks, threads per rank) with the defaults filled in and checked against this machine."""
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        nprocs = gpus if nprocs is None else nprocs
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or not 1 <= nprocs <= gpus:
            raise ConfigError(f"nprocs={nprocs!r} must be an integer from 1 to the {gpus} GPUs of this machine")
        return nprocs, check_threads(threads or 1)
    cores = os.cpu_count() or 1
    if nprocs is None:
        threads = check_threads(threads or 1)
        nprocs = max(1, cores // threads)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"nprocs={nprocs!r} must be an integer >= 1")
    threads = check_threads(threads if threads is not None else max(1, cores // nprocs))
    return nprocs, threads


def _memory_per_rank(curves: DeviceProfile, nprocs: int) -> float:
    """A GPU's own memory; on a CPU the ranks share the machine's RAM (both as the profile recorded)."""
    return curves.memory_bytes if curves.device_type == "cuda" else curves.memory_bytes / nprocs


@dataclass(frozen=True)
class LocalProfile:
    """What ``Cluster.local`` measured: one node of ``ranks`` devices like ``fitted`` joined by ``intra_node``
    (``inter_node`` a preset: one machine measures no network), and the curves and fits behind them."""

    ranks: int
    fitted: Device
    intra_node: Link
    inter_node: Link
    device: DeviceProfile
    device_fit: DeviceFitReport
    links: LinkProfile | None            # None with one rank
    link_fits: Mapping[str, CollectiveFitResult]
    db_path: str

    @property
    def conditions(self) -> tuple[ProfileConditions, ...]:
        """What the device and (with two ranks or more) the links were measured under."""
        links = () if self.links is None or self.links.conditions is None else (self.links.conditions,)
        return (self.device.conditions,) + links


def local_profile(nprocs: int | None = None, threads_per_rank: int | None = None, *,
                  profile_db: str | os.PathLike | None = None, refresh: bool = False, strict: bool = False,
                  progress: bool = True) -> LocalProfile:
    """This machine, measured (or loaded from ``profile_db``; ``refresh=True`` measures again); a noisy
    measurement warns, or with ``strict=True`` is refused (module docstring)."""
    device = accelerator()
    nprocs, threads = _ranks(device, nprocs, threads_per_rank)
    name = device_name(device, threads)
    db = ProfileDB(profile_db)
    curves = None if refresh else load_profile(db, name)
    if curves is None:
        curves = _least_noisy(lambda: measure_device(device, threads, progress=progress), strict)
        save_profile(db, curves)
    else:
        _check_cached(curves.conditions, db, strict)
    links = _links(db, name, device, nprocs, threads, refresh, strict, progress)
    db.save()
    dispatch = links.dispatch_fwd_seconds if links is not None else 0.0
    fitted, report = fit_device(curves, memory=_memory_per_rank(curves, nprocs), dispatch_overhead=dispatch)
    fitted = replace(fitted, name=name, threads=threads if device.type == "cpu" else 0,
                     dispatch_overhead_backward=links.dispatch_bwd_seconds if links is not None else 0.0,
                     concurrency_slowdown=links.concurrency_slowdown if links is not None else 1.0,
                     dtensor_step_overhead=links.dtensor_step_seconds if links is not None else 0.0)
    preset_intra, preset_inter = _preset_links(device)
    fits = fit_profile(links) if links is not None else {}
    intra = replace(to_link(fits, nprocs, name="shm" if device.type == "cpu" else "NVLink"),
                    overlap=links.overlap_fraction, context_latency=links.context_seconds["all_reduce"],
                    context_latency_p2p=links.context_seconds["p2p"]) if fits else preset_intra
    inter = replace(preset_inter, name=f"{preset_inter.name or 'inter-node'} (preset, not measured)")
    return LocalProfile(nprocs, fitted, intra, inter, curves, report, links, fits, str(db.path))


def _links(db: ProfileDB, name: str, device: torch.device, nprocs: int, threads: int, refresh: bool,
           strict: bool, progress: bool) -> LinkProfile | None:
    """The link profile of ``nprocs`` ranks (None for one rank: nothing to measure)."""
    if nprocs < 2:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    key = links_key(backend, nprocs)
    record = None if refresh else db.get(name, "links", key)
    if record is not None:
        try:
            cached = LinkProfile.from_record(record)
        except ConfigError:
            pass        # a record of an older autopar, without what this one measures: measure again
        else:
            if cached.conditions is not None:
                _check_cached(cached.conditions, db, strict, stacklevel=5)
                return cached
    profile = _least_noisy(lambda: measure_links(nprocs, threads, backend=backend, progress=progress), strict,
                           stacklevel=5)
    db.put(name, "links", key, profile.to_record())
    return profile


Measured = TypeVar("Measured", DeviceProfile, LinkProfile)


def _least_noisy(measure: Callable[[], Measured], strict: bool, stacklevel: int = 4) -> Measured:
    """``measure()`` until its conditions are clean, at most MAX_ATTEMPTS times; the least noisy, with the
    attempts counted in its conditions; warned about (or, ``strict``, refused) when still noisy, and refused
    whatever ``strict`` when it cannot be priced with (a flat link fit). ``stacklevel`` points the warning at
    the caller of ``Cluster.local``."""
    best = None
    for attempt in range(1, MAX_ATTEMPTS + 1):
        result = measure()
        if best is None or result.conditions.severity() < best.conditions.severity():
            best = result
        if not result.conditions.noisy:
            break
    best = replace(best, conditions=replace(best.conditions, attempts=attempt))
    if best.conditions.noisy:
        text = (f"the {best.conditions.part} of this machine was measured {attempt} times and every measurement "
                f"was noisy; the least noisy ({', '.join(best.conditions.noise())})")
        unusable = bool(best.conditions.flat)     # a flat link fit: no bandwidth to price with
        if strict or unusable:
            why, advice = (("it cannot be priced with", REFRESH_ADVICE) if unusable else
                           ("strict=True", f"{REFRESH_ADVICE}, or pass strict=False to plan with it"))
            raise NoisyProfileError(f"{text} is refused ({why}): {advice}")
        warnings.warn(f"{text} is cached and plans priced with it may be off: {REFRESH_ADVICE}",
                      NoisyProfileWarning, stacklevel=stacklevel)
    return best


def _check_cached(conditions: ProfileConditions, db: ProfileDB, strict: bool, stacklevel: int = 4) -> None:
    """Warn about (or, ``strict``, refuse) a noisy measurement loaded from the cache."""
    if not conditions.noisy:
        return
    text = (f"the cached {conditions.part} profile in {db.path} was measured at {conditions.measured_at} under "
            f"load ({', '.join(conditions.noise())})")
    if strict:
        raise NoisyProfileError(f"{text} and strict=True refuses it: {REFRESH_ADVICE}")
    warnings.warn(f"{text}: plans priced with it may be off; {REFRESH_ADVICE}", NoisyProfileWarning,
                  stacklevel=stacklevel)


def _preset_links(device: torch.device) -> tuple:
    """The (intra, inter) preset links of the nearest preset family, for what cannot be measured here."""
    if device.type == "cpu":
        return link_presets("cpu")
    gpu = torch.cuda.get_device_name(device)
    # the preset whose name's first part the device's name holds, the longest first (GB200 before B200)
    names = sorted((n for n in DEVICE_PRESETS if n != "cpu"), key=lambda n: -len(n.split("-")[0]))
    family = next((n for n in names if n.split("-")[0].lower() in gpu.lower()), "H100-SXM")
    return link_presets(family)
