r"""Link timing: the collectives of this machine's ranks, measured in one spawn (links.py fits them).

**What is measured.** :func:`measure_links` spawns ``n`` local ranks once (gloo on CPU, NCCL with
one GPU per rank) and times, for every per-rank size ``S`` in bytes (float32 buffers; ``S`` has
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

The same spawn measures the **DTensor dispatch overhead** of autopar's runtime: the op mix of
a tensor-parallel layer at a negligible size (a linear whose weight is ``Shard(0)``, gelu, two
views, two transposes, a multiply, a sum), exported and run node by node through the runtime's
``NodeRunner``, on plain tensors and on DTensors of a 1-D mesh of all ranks, forward and
forward + backward. Per node,

    fwd = (t_DT(forward) - t_plain(forward)) / nodes
    bwd = ([t_DT(fb) - t_plain(fb)] - [t_DT(forward) - t_plain(forward)]) / nodes

Each ``t`` is the median over :data:`DISPATCH_BLOCKS` blocks of 50-200 calls, the plain and DTensor
blocks alternating; the MAX over ranks is reported, and a difference below 0 (timing noise) as 0.
(A replicated ``x + y`` alone costs a fraction of this: sharding propagation of views and
sharded matmuls, and the runtime's wrapping of every value, are what cost.)

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
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import ConfigError, RuntimeFailure
from ..progress import progress_bar
from .host import check_threads
from .links import COLLECTIVES, LinkProfile

DEFAULT_SIZES: tuple[int, ...] = tuple(int(s) for s in np.geomspace(2 ** 10, 24 * 2 ** 20, 16))
"""Per-rank bytes measured by default: 16 sizes log-spaced from 1 KiB to 24 MiB (below the 32 MiB
from which gloo's all-gather and reduce-scatter slow down, see "Two segments")."""
BLOCK_SECONDS = 2e-3
"""One repeat's back-to-back calls last about this long (one call when a call is longer)."""
MAX_CALLS_PER_BLOCK = 32
"""The most calls one repeat times."""
DISPATCH_BLOCKS = 21
"""Blocks the dispatch overhead is the median over (per variant)."""

_FLOAT_BYTES = 4


# --- Measuring -------------------------------------------------------------------------------------
def round_sizes(sizes: Sequence[int], nprocs: int) -> tuple[int, ...]:
    """Per-rank bytes rounded to the nearest multiple of ``4 * nprocs`` (at least one), sorted, unique."""
    quantum = _FLOAT_BYTES * nprocs
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
    """Time every collective of :data:`COLLECTIVES` at every size, and the DTensor dispatch overhead,
    on ``nprocs`` local ranks spawned once (module docstring: what is measured).

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
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "links.json")
        args = (nprocs, _free_port(), threads_per_rank, list(sizes), warmup, repeats, backend, out, progress)
        try:
            mp.start_processes(_rank_main, args=args, nprocs=nprocs, join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise RuntimeFailure(f"link profiling on {nprocs} {backend} ranks failed: {exc}") from exc
        with open(out) as fh:
            record = json.load(fh)
    return LinkProfile.from_record(record)


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
        fwd, bwd = _dispatch_overhead(device, nprocs)
        overlap = _overlap(device)
        context = _in_context(device, rank)
        concurrency = _concurrency(device, rank, nprocs)
        if rank == 0:
            record = LinkProfile(backend=backend, nprocs=nprocs, threads_per_rank=threads, samples=samples,
                                 dispatch_fwd_seconds=fwd, dispatch_bwd_seconds=bwd,
                                 overlap_fraction=overlap, context_seconds=context,
                                 concurrency_slowdown=concurrency).to_record()
            with open(out_path, "w") as fh:
                json.dump(record, fh)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


OVERLAP_BYTES = 4 * 2 ** 20
OVERLAP_TRIALS = 9


def _overlap(device: torch.device) -> float:
    """Fraction of an asynchronous all-reduce of OVERLAP_BYTES that a block of matmuls issued meanwhile
    hides: ``o = (T_c + T_a - T_both) / min(T_c, T_a)`` clipped to [0, 1], with ``T_a`` the all-reduce
    alone, ``T_c`` the compute alone (sized to take about ``T_a``), ``T_both`` the two together; each
    the mean over OVERLAP_TRIALS of the max over ranks. NCCL on GPUs overlaps (its kernels use their own
    SMs); gloo's threads compete with the compute for the CPU cores."""
    import torch.distributed as dist
    buf = torch.randn(OVERLAP_BYTES // _FLOAT_BYTES, device=device)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)

    def comm_alone() -> None:
        dist.all_reduce(buf, async_op=True).wait()

    t_a = _mean_max(comm_alone, device)
    per = _mean_max(lambda: [a @ b for _ in range(10)], device) / 10
    n = max(1, round(t_a / max(per, 1e-9)))

    def compute() -> None:
        for _ in range(n):
            a @ b

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_c, t_both = _mean_max(compute, device), _mean_max(both, device)
    hidden = (t_c + t_a - t_both) / max(min(t_c, t_a), 1e-9)
    return float(min(1.0, max(0.0, hidden)))


def _mean_max(fn: Callable[[], object], device: torch.device) -> float:
    """Mean over OVERLAP_TRIALS barrier-started calls of ``fn`` of the slowest rank's seconds."""
    import torch.distributed as dist
    fn()
    times = []
    for _ in range(OVERLAP_TRIALS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.fmean(_max_over_ranks(times, device))


CONTEXT_COMPUTE_SECONDS = 0.02
CONTEXT_CALLS = 20
CONTEXT_BYTES = (64 * 2 ** 10, 2 * 2 ** 20)


def _in_context(device: torch.device, rank: int) -> dict[str, float]:
    """Extra seconds a collective costs when it follows a block of compute (as in a training step, where
    the backend's threads have gone to sleep and the ranks arrive apart) rather than another collective:
    ``mean(T(compute; op)) - mean(T(compute)) - mean(T(op; op))`` over CONTEXT_CALLS calls without
    barriers, the slowest rank's, averaged over CONTEXT_BYTES; for the all-reduce and for p2p
    (rank 0 sends to rank 1, both after their compute)."""
    import torch.distributed as dist
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    per = _mean_max(lambda: [a @ b for _ in range(10)], device) / 10
    n = max(1, round(CONTEXT_COMPUTE_SECONDS / max(per, 1e-9)))

    def compute() -> None:
        for _ in range(n):
            a @ b

    def loop(fn: Callable[[], object]) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CONTEXT_CALLS):
            fn()
        _sync(device)
        return _max_over_ranks([(time.perf_counter() - start) / CONTEXT_CALLS], device)[0]

    out = {}
    for kind in ("all_reduce", "p2p"):
        extra = []
        for nbytes in CONTEXT_BYTES:
            buf = torch.randn(nbytes // _FLOAT_BYTES, device=device)
            if kind == "all_reduce":
                def op() -> None:
                    dist.all_reduce(buf)
            else:
                def op() -> None:
                    if rank == 0:
                        dist.send(buf, 1)
                    elif rank == 1:
                        dist.recv(buf, 0)
            op()
            extra.append(loop(lambda: (compute(), op())) - loop(compute) - loop(op))
        out[kind] = max(0.0, statistics.fmean(extra))
    return out


CONCURRENCY_TRIALS = 9


class _Training(torch.nn.Module):
    """A training step's op mix at the size of a small model's layer: two linears with a GELU between."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))).pow(2).mean()


def _concurrency(device: torch.device, rank: int, nprocs: int) -> float:
    """How much longer a rank's compute takes when every rank computes at once than when it computes
    alone (the step's compute is the slowest rank's): ``median_t max_r T_together / median T_alone``
    over CONCURRENCY_TRIALS rounds of a forward and backward of :class:`_Training` (each round: every
    rank alone in turn, the others waiting at a barrier, then all at once), at least 1. Ranks that
    share cores, caches or memory bandwidth (CPU ranks) slow each other down, and the ranks of one
    step drift apart by the machine's noise, which the slowest sets; GPUs of one node barely do."""
    import torch.distributed as dist
    model = _Training().to(device)
    x = torch.randn(1024, 256, device=device)

    def step() -> float:
        _sync(device)
        start = time.perf_counter()
        model(x).backward()
        _sync(device)
        return time.perf_counter() - start

    for _ in range(3):
        step()
    alone, together = [], []
    for _ in range(CONCURRENCY_TRIALS):
        for r in range(nprocs):
            dist.barrier()
            if rank == r:
                alone.append(step())
            dist.barrier()
        dist.barrier()
        together.append(step())
    alone = _max_over_ranks([statistics.median(alone)], device)[0]   # every rank's median alone, the largest
    together = _max_over_ranks(together, device)
    return max(1.0, statistics.median(together) / alone)


class _Buffers:
    """Two float32 buffers of the largest size; every op works on views of them (one allocation)."""

    def __init__(self, max_bytes: int, device: torch.device) -> None:
        self.send = torch.ones(max_bytes // _FLOAT_BYTES, device=device)
        self.recv = torch.empty(max_bytes // _FLOAT_BYTES, device=device)

    def views(self, nbytes: int, send_div: int = 1, recv_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        numel = nbytes // _FLOAT_BYTES
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(op: Callable[[], object], calls: int, device: torch.device) -> list[float]:
    """Seconds of each of ``calls`` back-to-back calls of ``op``."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _max_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    import torch.distributed as dist
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


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
             for t in _max_over_ranks(fastest, device)]
    times: list[list[float]] = [[] for _ in tasks]
    steps = [(r, i) for r in range(repeats) for i in random.Random(r).sample(range(len(tasks)), len(tasks))]
    for _, i in progress_bar(steps, desc=f"links x{nprocs}", enabled=show_progress):
        dist.barrier()
        times[i].extend(_time_calls(ops[i], calls[i], device))
    flat = _max_over_ranks([t for per_task in times for t in per_task], device)
    out, pos = [], 0
    for per_task in times:
        out.append(statistics.fmean(flat[pos:pos + len(per_task)]))
        pos += len(per_task)
    return out


def _per_call(fns: Sequence[Callable[[], object]], device: torch.device, calls: int) -> list[float]:
    """For each of ``fns``, the median over :data:`DISPATCH_BLOCKS` blocks of ``calls`` calls of the seconds
    per call; the functions' blocks alternate, so a slow spell of the machine hits them alike."""
    for fn in fns:
        for _ in range(max(10, calls // 10)):
            fn()
    blocks: list[list[float]] = [[] for _ in fns]
    for _ in range(DISPATCH_BLOCKS):
        for fn, per in zip(fns, blocks):
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            per.append((time.perf_counter() - start) / calls)
    return [statistics.median(per) for per in blocks]


class _LayerMix(torch.nn.Module):
    """The op mix of a tensor-parallel transformer layer at a negligible size: a linear (its weight split
    by rows across the mesh), gelu, two views, two transposes, a multiply and a sum."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.weight = torch.nn.Parameter(torch.randn(rows, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, self.weight))
        h = h.view(-1, self.rows).view(2, 4, self.rows).transpose(1, 2).transpose(1, 2)
        return (h * h).sum()


def _dispatch_overhead(device: torch.device, nprocs: int) -> tuple[float, float]:
    """(forward, backward) extra seconds per op when autopar's runtime runs ops as DTensors, max over ranks.

    The exported :class:`_LayerMix` is run node by node through the runtime's own ``NodeRunner``,
    once on plain tensors (no mesh) and once on DTensors of a 1-D mesh of all ranks (input
    ``Replicate``, weight ``Shard(0)``), forward and forward + backward; per node,
    ``fwd = (t_DT - t_plain) / nodes`` and ``bwd = ([t_DT(fb) - t_plain(fb)] - [t_DT - t_plain]) / nodes``."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

    from ..runtime.chunk import NodeRunner

    mesh = init_device_mesh(device.type, (nprocs,))
    rows = 8 * nprocs
    program = torch.export.export(_LayerMix(rows).to(device), (torch.randn(2, 4, 8, device=device),), strict=False)
    split = SimpleNamespace(node_map={n.name: n for n in program.graph.nodes}, program=program)
    calls = [n.name for n in program.graph.nodes if n.op == "call_function"]
    weight_name, input_name = [n.name for n in program.graph.nodes if n.op == "placeholder"]

    def variant(dtensor: bool) -> tuple[Callable[[], object], Callable[[], object]]:
        runner = NodeRunner(split, mesh if dtensor else None, {})
        x, w = torch.randn(2, 4, 8, device=device), torch.randn(rows, 8, device=device)
        if dtensor:
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            w = DTensor.from_local(w.chunk(nprocs)[0].contiguous(), mesh, [Shard(0)], run_check=False)
        w = w.detach().requires_grad_()

        def forward() -> torch.Tensor:
            env: dict[str, Any] = {weight_name: w, input_name: x}
            for name in calls:
                env[name] = runner.run(name, env)
            return env[calls[-1]]

        def fwd_bwd() -> None:
            w.grad = None
            forward().backward()

        return forward, fwd_bwd

    (plain_fwd, plain_fb), (dt_fwd, dt_fb) = variant(False), variant(True)
    p_fwd, d_fwd, p_fb, d_fb = _per_call([plain_fwd, dt_fwd, plain_fb, dt_fb], device, 50)
    fwd = (d_fwd - p_fwd) / len(calls)
    bwd = ((d_fb - p_fb) - (d_fwd - p_fwd)) / len(calls)
    fwd, bwd = _max_over_ranks([fwd, bwd], device)
    return max(0.0, fwd), max(0.0, bwd)
