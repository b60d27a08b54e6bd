r"""Link timing: the collectives of this machine's ranks, measured in one launch (links.py fits them).

**What is measured.** :func:`measure_links` starts ``n`` local ranks once, as child interpreters (gloo on CPU,
NCCL with one GPU per rank), and times, for every per-rank size ``S`` in bytes (float32 buffers; ``S`` has
the meaning of cost_model/comm.py: all-reduce the buffer, all-gather the OUTPUT,
reduce-scatter the INPUT, all-to-all the send buffer, p2p the message):

* ``all_reduce``, ``all_gather`` (into one tensor), ``reduce_scatter`` (from one tensor),
  ``all_to_all`` (``all_to_all_single``) over all ``n`` ranks;
* ``p2p``: ranks 0 and 1 play ping-pong (0 sends, 1 receives and sends back); the one-way
  time is half the round trip, which needs no clock shared between the two ranks.

One repeat of a (collective, size) is: a barrier, then ``k`` back-to-back calls, each timed
with ``time.perf_counter`` (CUDA: a synchronisation before the clock stops). ``k`` is the same
on every rank and makes a repeat last about :data:`BLOCK_SECONDS` (from the slowest rank's
fastest warm-up call; ``k = 1`` for large messages), so that small messages get many timings
and the barrier's exit skew touches only the first of them. Every call's time is the MAX over
ranks (a collective ends when its last rank is done; one all-reduce(MAX) of all the times at
the end), and the sample is the MEAN over all timed calls of all repeats: a training step is a
sum of many collectives, so what it pays per call is the mean, stalls (below) included. Every repeat visits
the (collective, size) pairs in a new order, the same on every rank, so that a burst of load on
the machine hits one repeat of many sizes rather than every repeat of one size. All calls work
on views of two buffers of the largest size, allocated once.

Gloo's ``reduce_scatter_tensor`` (torch 2.13) is supported but is NOT a ring reduce-scatter:
ProcessGroupGloo clones the input, all-reduces all of it and copies this rank's chunk out,
so it costs about an all-reduce of ``S``. The profile records what the backend really does;
its fit then gives a (low) effective ``B`` for reduce-scatter that the cost model uses as is.

The same ranks then measure what collectives and compute cost inside a training step (overlap,
in-context extra, concurrency slowdown, the tensor-parallel runtime's per-op dispatch overhead):
step_conditions.py. The profile records the load of other processes around the launch
(autopar/conditions.py).

**Noise.** On a small VM gloo's times are bimodal: most calls take the link's time, but a
fraction (0-60%, varying with size and over time, even on an idle machine) waits for a
scheduler tick (4 ms at HZ=250) in one of the many thread hand-offs of a gloo collective. A
median would price a collective at the fast mode and a step full of collectives far below
what it measures (the 2 MB all-reduces of a tensor-parallel step cost ~4 ms each in context
against a 1.5 ms median); the mean prices the stalls at their frequency, and, being about
the same for every size, they mostly land in ``alpha``. bench/link_fit.py shows how far the fit
then predicts sizes it did not see.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..conditions import ProfileConditions
from ..errors import ConfigError, RuntimeFailure
from ..progress import progress_bar
from .host import LoadMeter, check_threads
from .links import COLLECTIVES, LinkProfile, fit_profile, links_key
from .step_conditions import (FLOAT_BYTES, concurrency_slowdown, dispatch_overhead, dtensor_step_overhead,
                              in_context, max_over_ranks, overlap_fraction, sync)

DEFAULT_SIZES: tuple[int, ...] = tuple(int(s) for s in np.geomspace(2 ** 10, 24 * 2 ** 20, 16))
"""Per-rank bytes measured by default: 16 sizes log-spaced from 1 KiB to 24 MiB (below the 32 MiB
from which gloo's all-gather and reduce-scatter slow down, see "Two segments")."""
BLOCK_SECONDS = 2e-3
"""One repeat's back-to-back calls last about this long (one call when a call is longer)."""
MAX_CALLS_PER_BLOCK = 32
"""The most calls one repeat times."""


# --- Measuring -------------------------------------------------------------------------------------
def round_sizes(sizes: Sequence[int], nprocs: int) -> tuple[int, ...]:
    """Per-rank bytes rounded to the nearest multiple of ``4 * nprocs`` (at least one), sorted, unique."""
    quantum = FLOAT_BYTES * nprocs
    out = set()
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(f"size {size!r} must be an integer number of bytes >= 1")
        out.add(max(1, round(int(size) / quantum)) * quantum)
    return tuple(sorted(out))


def _pick_backend(backend: str | None, nprocs: int) -> str:
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend={backend!r} is not supported: use 'gloo' (CPU) or 'nccl' (CUDA), or None")
    if backend == "nccl":
        if not cuda:
            raise ConfigError("backend='nccl' needs CUDA, which is not available: use backend='gloo'")
        if torch.cuda.device_count() < nprocs:
            raise ConfigError(f"nprocs={nprocs} NCCL ranks need one GPU each but {torch.cuda.device_count()} are "
                              f"visible: use nprocs <= {torch.cuda.device_count()}")
    return backend


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_links(nprocs: int, threads_per_rank: int = 1, *, sizes: Sequence[int] | None = None, warmup: int = 2,
                  repeats: int = 5, backend: str | None = None, progress: bool = True) -> LinkProfile:
    """Time every collective of :data:`COLLECTIVES` at every size, and the tensor-parallel dispatch overhead,
    on ``nprocs`` local ranks started once (module docstring: what is measured).

    ``sizes``: per-rank bytes (default :data:`DEFAULT_SIZES`), rounded by :func:`round_sizes`.
    ``backend``: None picks NCCL when CUDA is available (one GPU per rank), else gloo.
    On a CPU, ``nprocs * threads_per_rank`` above the core count oversubscribes the cores and
    the times say more about the scheduler than the link.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 2:
        raise ConfigError(f"nprocs={nprocs!r} must be an integer >= 2 (p2p needs two ranks)")
    check_threads(threads_per_rank)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1 \
            or isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"repeats={repeats!r} must be an integer >= 1 and warmup={warmup!r} an integer >= 0")
    backend = _pick_backend(backend, nprocs)
    sizes = round_sizes(DEFAULT_SIZES if sizes is None else sizes, nprocs)
    if not sizes:
        raise ConfigError("sizes is empty: give at least one per-rank size in bytes")
    if backend == "gloo" and nprocs * threads_per_rank > (os.cpu_count() or 1):
        warnings.warn(f"{nprocs} ranks x {threads_per_rank} threads oversubscribe this machine's {os.cpu_count()} "
                      "cores: the link times will include scheduling delays", stacklevel=2)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory() as tmp, LoadMeter() as load:
        out = os.path.join(tmp, "links.json")
        args = dict(nprocs=nprocs, port=_free_port(), threads=threads_per_rank, sizes=list(sizes), warmup=warmup,
                    repeats=repeats, backend=backend, out_path=out, show_progress=progress)
        _run_ranks(args, tmp)
        with open(out) as fh:
            record = json.load(fh)
    # The ranks' own run-queue waits end with them: the links record the loads (the ranks are this
    # process's children), no spread (their per-call times are bimodal by nature, "Noise" above), and
    # the collectives whose fit comes out flat, which only stalls make of a link (autopar/conditions.py).
    conditions = ProfileConditions(part=f"links {links_key(backend, nprocs)}",
                                   device_type="cuda" if backend == "nccl" else "cpu", measured_at=started,
                                   torch_version=torch.__version__, threads=nprocs * threads_per_rank,
                                   cores=os.cpu_count() or 1, load_average=load.load_average,
                                   other_load=load.other_load, own_load=load.own_load, wait_fraction=None,
                                   spread=None)
    profile = LinkProfile.from_record(record | {"conditions": conditions.to_dict()})
    flat = tuple(kind for kind, fit in fit_profile(profile).items() if fit.beta <= 0)
    return replace(profile, conditions=replace(conditions, flat=flat))


_RANK_ENTRY = "import sys; from autopar.profiler.link_timing import _rank_cli; _rank_cli(sys.argv[1:])"
"""What each rank's interpreter runs: the ranks are fresh interpreters that import autopar, not the caller's
``__main__`` again, as multiprocessing's spawn would (a script calling ``Cluster.local`` without an
``if __name__ == "__main__":`` guard would start its own ranks from each rank; stdin has no file to re-run)."""
_TAIL_CHARS = 4000


def _run_ranks(args: dict[str, Any], tmp: str) -> None:
    """Run the ``args["nprocs"]`` ranks of :func:`_rank_main` as child interpreters and wait for all of them;
    the first that fails stops the others and raises RuntimeFailure with its standard error's tail. Rank 0
    writes to this process's standard error (its progress bar); the others' go to files read on failure.
    The children see this process's ``sys.path`` (a notebook's additions included)."""
    nprocs = args["nprocs"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs, logs = [], []
    try:
        for rank in range(nprocs):
            log = open(os.path.join(tmp, f"rank{rank}.err"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-c", _RANK_ENTRY, str(rank), json.dumps(args)],
                                          env=env, stdin=subprocess.DEVNULL,
                                          stderr=None if rank == 0 else log, stdout=None if rank == 0 else log))
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank = failed[0]
                logs[rank].seek(0)
                tail = logs[rank].read()[-_TAIL_CHARS:].strip()
                raise RuntimeFailure(f"link profiling on {nprocs} {args['backend']} ranks failed: rank {rank} "
                                     f"exited with code {codes[rank]}" + (f":\n{tail}" if tail else
                                                                        " (its output is above)"))
            if all(c == 0 for c in codes):
                return
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()


def _rank_cli(argv: Sequence[str]) -> None:
    """A rank's entry point (:data:`_RANK_ENTRY`): ``argv`` is the rank and :func:`_rank_main`'s other
    arguments as JSON."""
    _rank_main(int(argv[0]), **json.loads(argv[1]))


def _rank_main(rank: int, nprocs: int, port: int, threads: int, sizes: list[int], warmup: int, repeats: int,
               backend: str, out_path: str, show_progress: bool) -> None:
    """One rank of :func:`measure_links`; rank 0 writes the record to ``out_path``."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    extra: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=nprocs, timeout=timedelta(seconds=300), **extra)
    try:
        tasks = [(kind, size) for kind in COLLECTIVES for size in sizes]
        seconds = _time_tasks(tasks, rank, nprocs, device, warmup, repeats, show_progress and rank == 0)
        samples: dict[str, list[tuple[int, float]]] = {kind: [] for kind in COLLECTIVES}
        for (kind, size), t in zip(tasks, seconds):
            samples[kind].append((size, t / 2 if kind == "p2p" else t))  # p2p: a round trip is two messages
        fwd, bwd = dispatch_overhead(device, nprocs)
        dtensor_step = dtensor_step_overhead(device, nprocs)
        overlap = overlap_fraction(device)
        context = in_context(device, rank)
        concurrency = concurrency_slowdown(device, rank, nprocs)
        if rank == 0:
            record = LinkProfile(backend=backend, nprocs=nprocs, threads_per_rank=threads, samples=samples,
                                 dispatch_fwd_seconds=fwd, dispatch_bwd_seconds=bwd, dtensor_step_seconds=dtensor_step,
                                 overlap_fraction=overlap, context_seconds=context,
                                 concurrency_slowdown=concurrency).to_record()
            with open(out_path, "w") as fh:
                json.dump(record, fh)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


class _Buffers:
    """Two float32 buffers of the largest size; every op works on views of them (one allocation)."""

    def __init__(self, max_bytes: int, device: torch.device) -> None:
        self.send = torch.ones(max_bytes // FLOAT_BYTES, device=device)
        self.recv = torch.empty(max_bytes // FLOAT_BYTES, device=device)

    def views(self, nbytes: int, send_div: int = 1, recv_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        numel = nbytes // FLOAT_BYTES
        return self.send[:numel // send_div], self.recv[:numel // recv_div]


def _make_op(kind: str, nbytes: int, rank: int, nprocs: int, buffers: _Buffers) -> Callable[[], object]:
    """One call of ``kind`` on ``nbytes`` per-rank bytes (p2p: one round trip between ranks 0 and 1)."""
    import torch.distributed as dist
    if kind == "all_reduce":
        buf, _ = buffers.views(nbytes)
        return lambda: dist.all_reduce(buf)
    if kind == "all_gather":
        inp, out = buffers.views(nbytes, send_div=nprocs)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if kind == "reduce_scatter":
        inp, out = buffers.views(nbytes, recv_div=nprocs)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if kind == "all_to_all":
        inp, out = buffers.views(nbytes)
        return lambda: dist.all_to_all_single(out, inp)
    if kind == "p2p":
        buf, _ = buffers.views(nbytes)
        if rank == 0:
            return lambda: (dist.send(buf, 1), dist.recv(buf, 1))
        if rank == 1:
            return lambda: (dist.recv(buf, 0), dist.send(buf, 0))
        return lambda: None
    raise ConfigError(f"unknown collective {kind!r}; known: {list(COLLECTIVES)}")


def _time_calls(op: Callable[[], object], calls: int, device: torch.device) -> list[float]:
    """Seconds of each of ``calls`` back-to-back calls of ``op``."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        op()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def _time_tasks(tasks: list[tuple[str, int]], rank: int, nprocs: int, device: torch.device, warmup: int,
                repeats: int, show_progress: bool) -> list[float]:
    """Seconds per call of every (collective, bytes) task (module docstring: one repeat).

    Every repeat visits the tasks in a new order (the same on every rank), so a burst of load
    from other processes hits one repeat of many tasks rather than every repeat of one.
    """
    import random

    import torch.distributed as dist
    buffers = _Buffers(max(size for _, size in tasks), device)
    ops = [_make_op(kind, size, rank, nprocs, buffers) for kind, size in tasks]
    fastest = []  # the fastest warm-up call: a call the machine did not stall sets the block length
    for op in ops:
        fastest.append(min(_time_calls(op, max(1, warmup), device)))
    calls = [max(1, min(MAX_CALLS_PER_BLOCK, math.ceil(BLOCK_SECONDS / max(t, 1e-9))))
             for t in max_over_ranks(fastest, device)]
    times: list[list[float]] = [[] for _ in tasks]
    steps = [(r, i) for r in range(repeats) for i in random.Random(r).sample(range(len(tasks)), len(tasks))]
    for _, i in progress_bar(steps, desc=f"links x{nprocs}", enabled=show_progress):
        dist.barrier()
        times[i].extend(_time_calls(ops[i], calls[i], device))
    flat = max_over_ranks([t for per_task in times for t in per_task], device)
    out, pos = [], 0
    for per_task in times:
        out.append(statistics.fmean(flat[pos:pos + len(per_task)]))
        pos += len(per_task)
    return out
