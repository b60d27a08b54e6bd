"""Gloo worlds spawned once per test session, running the jobs the test process streams to them.

Spawning ranks costs seconds (each imports torch, autopar and transformers), and a test file's
parent has its own work to do (capture, plan, single-process references). So every distributed
test that needs ranks which live through its cases uses the session's :class:`World` of its
size: ``submit`` hands a job to every rank (a file, announced through the TCPStore this process
serves) and returns at once (the parent plans the next case while the ranks run this one), ``result`` waits for
every rank's answer.

A job is ``(function, args)``: ``function`` is ``"module:name"`` of a module in this folder,
called on every rank as ``function(rank, world, *args)`` with the default process group up. What
it returns (anything ``torch.save`` takes) comes back per rank; an exception comes back as
``{"error": traceback}``. After every job the ranks meet through the store (not a collective: a
rank that failed in the middle of one cannot desynchronise it) and re-create the process group on
a fresh PrefixStore, so one job's failure or leftover groups do not reach the next.

A rank killed by a signal (a crash in C++: gloo has segfaulted, rarely, in a broadcast after a
hundred jobs, a crash no rerun of that job alone reproduces) gets the world respawned once and the
jobs not yet answered replayed on the new ranks, in order, with a message on stderr naming the
crash; a second crash, or a rank that exits on its own (``os._exit``), fails the job being waited
on, naming the rank and its exit code (its stderr is in the test's captured output), and the next
``World`` use starts a fresh one. Tests that kill ranks on purpose (test_failures.py) or run torchrun (test_emit.py)
spawn their own.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import shutil
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
IDLE_TIMEOUT = 3600.0    # seconds a rank waits for the next job (the session ends it sooner)
GROUP_TIMEOUT = 120.0    # the process group's own timeout (collectives inside DTensor / FSDP2)
JOB_TIMEOUT = 900.0      # seconds a job may take on a rank before the test gives up on it


def _serve(rank: int, size: int, port: int, folder: str, first: int = 0) -> None:
    """One rank: run jobs in order from job ``first`` until the parent sends None."""
    sys.path.insert(0, HERE)
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    # autopar (and with it pulp) imported here, not inside the first job: pulp keeps an exception from its
    # import (pulp/apis/copt_api.py, a missing COPT library) whose traceback holds every frame of that
    # import, the first job's frame included, which would keep that job's program and its process groups
    # (each with gloo threads that keep polling) alive for the whole session
    importlib.import_module("autopar")
    import faulthandler
    faulthandler.enable(file=sys.stderr)   # a C++ crash prints this rank's Python stack
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=IDLE_TIMEOUT))
    k = first
    while True:
        store.get(f"job/{k}")    # waits until the parent has written the job's file
        with open(os.path.join(folder, f"job{k}.pkl"), "rb") as f:
            job = pickle.load(f)
        if job is None:
            break
        dist.init_process_group("gloo", store=dist.PrefixStore(f"job{k}", store), rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
        name, args = job
        try:
            module, function = name.split(":")
            out = getattr(importlib.import_module(module), function)(rank, size, *args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        torch.save(out, os.path.join(folder, f"result{k}.{rank}.pt"))   # the store takes values up to 8 MB
        store.set(f"result/{k}/{rank}", b"1")
        store.set(f"done/{k}/{rank}", b"1")   # every rank is done with this job's group before it goes
        store.wait([f"done/{k}/{r}" for r in range(size)])
        del out
        _release_groups()
        dist.destroy_process_group()
        k += 1


def _release_groups() -> None:
    """Drop the references this rank still holds to the finished job's process groups, so that their
    gloo threads end with the job. The job's program sits in reference cycles (bound methods, hooks),
    freed only by the cycle collector; and DTensor caches what it plans per device mesh (torch's
    functools caches of sharding propagation and redistribution, the C++ fast path's cache, the
    redistribute planners), each mesh holding its process groups. Left alone, every configuration kind
    left its groups behind, each with a gloo TCP loop that wakes every 10 ms: by the end of a session
    hundreds of threads per rank, most of a core of polling (the suite's distributed half spent 300 s of
    system time). test_parallelize.py checks that a job leaves no thread behind. What survives (the
    ranks' caches of models and exports) is frozen: later collections skip it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    for cache in _torch_distributed_caches():
        cache.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()   # a thread-local cache
    clear_redistribute_planner_cache()
    gc.collect()
    gc.freeze()


_CACHES: list = []


def _torch_distributed_caches() -> list:
    """torch.distributed's functools caches (module and class level, and those torch creates lazily
    inside a function), each found once: among the objects created since the last ``gc.freeze()`` (the
    imports before the first job, then each job's), the ones ``gc.get_objects()`` lists; every cache
    found before is frozen, so no full scan (0.2 s) per job."""
    import functools
    # type(), not isinstance(): a dead weak proxy raises on the latter
    _CACHES.extend(obj for obj in gc.get_objects() if type(obj) is functools._lru_cache_wrapper
                   and (obj.__module__ or "").startswith("torch.distributed"))
    return _CACHES


class World:
    """``size`` gloo ranks serving jobs; see the module docstring."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.folder = tempfile.mkdtemp(prefix=f"autopar-world{size}-")
        self.next = 0
        self.broken: str | None = None
        self.respawns = 1      # crashes (a rank killed by a signal) survived by respawning
        self._spawn(0)

    def _spawn(self, first: int) -> None:
        """Fresh ranks on a fresh store, serving from job ``first``; every job from it on is posted again."""
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=IDLE_TIMEOUT))
        self.ranks = mp.start_processes(_serve, args=(self.size, self.store.port, self.folder, first),
                                        nprocs=self.size, join=False, start_method="spawn")
        for k in range(first, self.next):
            self.store.set(f"job/{k}", b"1")

    def submit(self, function: str, *args: Any) -> int:
        """Start ``function(rank, size, *args)`` on every rank after the jobs before it; its number."""
        if self.broken:
            raise RuntimeError(self.broken)
        k = self.next
        self._post(k, (function, args))
        self.next += 1
        return k

    def _post(self, k: int, job: Any) -> None:
        with open(os.path.join(self.folder, f"job{k}.pkl"), "wb") as f:
            pickle.dump(job, f)
        self.store.set(f"job/{k}", b"1")

    def result(self, k: int, timeout: float = JOB_TIMEOUT) -> list[Any]:
        """What job ``k`` returned on each rank (waits for it)."""
        keys = [f"result/{k}/{r}" for r in range(self.size)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):   # polled: a blocking wait would not notice a dead rank
            if self.broken:
                raise RuntimeError(self.broken)
            dead = [(r, p.exitcode) for r, p in enumerate(self.ranks.processes) if not p.is_alive()]
            if dead and self.respawns > 0 and all(c is not None and c < 0 for _, c in dead):
                self.respawns -= 1
                print(f"worlds.py: rank(s) {dead} of the {self.size}-rank test world were killed by a signal "
                      f"during job {k}; respawning the world and replaying jobs {k}..{self.next - 1}",
                      file=sys.stderr, flush=True)
                for p in self.ranks.processes:
                    if p.is_alive():
                        p.kill()
                    p.join()
                self._spawn(k)
                continue
            if dead:
                self.broken = (f"rank(s) {', '.join(f'{r} (exit code {c})' for r, c in dead)} of the "
                               f"{self.size}-rank test world died during job {k}; their stderr is above")
                raise RuntimeError(self.broken)
            if time.monotonic() > deadline:
                self.broken = f"job {k} of the {self.size}-rank test world took over {timeout:.0f} s"
                raise RuntimeError(self.broken)
            time.sleep(0.02)
        out = []
        for r in range(self.size):
            path = os.path.join(self.folder, f"result{k}.{r}.pt")
            out.append(torch.load(path, weights_only=False))
            os.remove(path)
        return out

    def run(self, function: str, *args: Any) -> list[Any]:
        return self.result(self.submit(function, *args))

    def close(self) -> None:
        if not self.broken:
            self._post(self.next, None)
            for p in self.ranks.processes:
                p.join(timeout=60)
        for p in self.ranks.processes:
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_WORLDS: dict[int, World] = {}


def world(size: int) -> World:
    """The session's world of ``size`` ranks (a fresh one if the last one broke)."""
    w = _WORLDS.get(size)
    if w is None or w.broken:
        if w is not None:
            w.close()
        w = _WORLDS[size] = World(size)
    return w


def close_all() -> None:
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()
