"""What collectives and compute cost inside a training step, measured in link_timing.py's spawn.

link_timing.py times collectives back to back; a step interleaves them with compute. This module
measures, on the same ranks, what that changes (each function's docstring gives its formula):

* :func:`overlap_fraction`: how much of an asynchronous all-reduce a block of matmuls hides;
* :func:`in_context`: the extra seconds a collective costs after compute rather than after another
  collective (the backend's threads asleep, the ranks arriving apart);
* :func:`concurrency_slowdown`: how much longer compute takes when every rank computes at once;
* :func:`dispatch_overhead`: the **per-op host cost of the tensor-parallel runtime** beyond running
  the op (reading each argument through the lowering's conversion, the shard's shape check);
* :func:`dtensor_step_overhead`: the extra seconds **per parameter tensor of an AdamW step on DTensor
  parameters** (FSDP2's, ZeRO-2/3) over the same step on plain tensors of the shard's size: every op of
  the update goes through DTensor's dispatch (its sharding propagation). The lowered tensor-parallel code
  above runs on plain tensors, so its overhead says nothing of this one.

The dispatch overhead is measured on the op mix of a layer at a negligible size (a linear, gelu,
two views, two transposes, a multiply, a sum), exported and emitted as the runtime emits a layer
(codegen/layers.py), once plain and once lowered for tensor parallelism, forward and forward +
backward. Per node,

    fwd = (t_tp(forward) - t_plain(forward)) / nodes
    bwd = ([t_tp(fb) - t_plain(fb)] - [t_tp(forward) - t_plain(forward)]) / nodes

Each ``t`` is the median over :data:`DISPATCH_BLOCKS` blocks of 50-200 calls, the two variants'
blocks alternating; the MAX over ranks is reported, and a difference below 0 (timing noise) as 0.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

FLOAT_BYTES = 4
DISPATCH_BLOCKS = 21
"""Blocks the dispatch overhead is the median over (per variant)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    import torch.distributed as dist
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


OVERLAP_BYTES = 4 * 2 ** 20
OVERLAP_TRIALS = 9


def overlap_fraction(device: torch.device) -> float:
    """Fraction of an asynchronous all-reduce of OVERLAP_BYTES that a block of matmuls issued meanwhile
    hides: ``o = (T_c + T_a - T_both) / min(T_c, T_a)`` clipped to [0, 1], with ``T_a`` the all-reduce
    alone, ``T_c`` the compute alone (sized to take about ``T_a``), ``T_both`` the two together; each
    the mean over OVERLAP_TRIALS of the max over ranks. NCCL on GPUs overlaps (its kernels use their own
    SMs); gloo's threads compete with the compute for the CPU cores."""
    import torch.distributed as dist
    buf = torch.randn(OVERLAP_BYTES // FLOAT_BYTES, device=device)
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
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.fmean(max_over_ranks(times, device))


CONTEXT_COMPUTE_SECONDS = 0.02
CONTEXT_CALLS = 20
CONTEXT_BYTES = (64 * 2 ** 10, 2 * 2 ** 20)


def in_context(device: torch.device, rank: int) -> dict[str, float]:
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
        sync(device)
        return max_over_ranks([(time.perf_counter() - start) / CONTEXT_CALLS], device)[0]

    out = {}
    for kind in ("all_reduce", "p2p"):
        extra = []
        for nbytes in CONTEXT_BYTES:
            buf = torch.randn(nbytes // FLOAT_BYTES, device=device)
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


def concurrency_slowdown(device: torch.device, rank: int, nprocs: int) -> float:
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
        sync(device)
        start = time.perf_counter()
        model(x).backward()
        sync(device)
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
    alone = max_over_ranks([statistics.median(alone)], device)[0]   # every rank's median alone, the largest
    together = max_over_ranks(together, device)
    return max(1.0, statistics.median(together) / alone)


def dtensor_step_overhead(device: torch.device, nprocs: int) -> float:
    """Seconds per parameter tensor that torch's AdamW step (its default implementation on this device) takes
    more on a DTensor sharded over all ``nprocs`` ranks (``Shard(0)``, as FSDP2 shards) than on a plain tensor
    of the local shard's size: ``t_dtensor - t_plain`` per step of one tensor, each the median of
    :data:`DISPATCH_BLOCKS` alternating blocks (:func:`_per_call`), the MAX over ranks, below 0 (noise) as 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (nprocs,))
    shape = (64 * nprocs, 64)
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(shape, device=device), mesh, [Shard(0)]))
    weight.grad = distribute_tensor(torch.randn(shape, device=device), mesh, [Shard(0)])
    plain = torch.nn.Parameter(weight.to_local().detach().clone())
    plain.grad = weight.grad.to_local().clone()
    sharded, local = torch.optim.AdamW([weight], lr=1e-6), torch.optim.AdamW([plain], lr=1e-6)
    t_dtensor, t_plain = _per_call([sharded.step, local.step], device, 20)
    return max(0.0, max_over_ranks([t_dtensor - t_plain], device)[0])


def _per_call(fns: Sequence[Callable[[], object]], device: torch.device, calls: int) -> list[float]:
    """For each of ``fns``, the median over :data:`DISPATCH_BLOCKS` blocks of ``calls`` calls of the seconds
    per call; the functions' blocks alternate, so a slow spell of the machine hits them alike."""
    for fn in fns:
        for _ in range(max(10, calls // 10)):
            fn()
    blocks: list[list[float]] = [[] for _ in fns]
    for _ in range(DISPATCH_BLOCKS):
        for fn, per in zip(fns, blocks):
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
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


def _mix_plan(graph, tp: int):
    """A plan for the exported :class:`_LayerMix` on a tensor-parallel group of ``tp`` ranks, every op kept whole
    (``plan.sharding.replicated``): its costs are not read, only what the compiler lowers."""
    from ..cluster import Cluster
    from ..config import PRECISION_DTYPES, ParallelConfig, Precision
    from ..plan import Plan, Stage, TimeBreakdown
    from ..plan.record import MemoryBreakdown
    from ..plan.sharding import replicated

    names = tuple(layer.name for layer in graph.layers)
    memory = MemoryBreakdown(0.0, 0.0, 0.0, 0.0, 0.0)
    stage = Stage(index=0, layers=names, chunks=(names,), param_count=0, fwd_time=0.0, bwd_time=0.0,
                  recompute_time=0.0, tp_comm_time=0.0, p2p_time=0.0, in_flight=1, activation_per_microbatch=0.0,
                  memory=memory)
    batch = graph.batch_size
    dtype = PRECISION_DTYPES.get(graph.float_dtype, "fp32")   # the mix's own, as it runs
    return Plan(model_name=graph.model_name, fingerprint=graph.fingerprint, structure=graph.structure,
                loss=graph.loss, cluster=Cluster.from_spec(f"1x{tp}xcpu"),
                config=ParallelConfig(tp=tp, micro_batch_size=batch), precision=Precision(compute=dtype, grads=dtype),
                global_batch_size=batch, micro_batches=1, step_time=0.0, peak_memory=0.0, throughput=0.0,
                model_flops=0.0, hardware_flops=0.0, breakdown=TimeBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
                stages=(stage,), fits=True, sharding=replicated(graph))


def dispatch_overhead(device: torch.device, nprocs: int) -> tuple[float, float]:
    """(forward, backward) extra seconds per op when autopar's runtime runs ops tensor-parallel, max over ranks.

    The exported :class:`_LayerMix` is compiled as ``parallelize`` compiles a plan (codegen/compile.py, on a
    plan keeping every op whole) and each layer emitted as the runtime emits it (codegen/layers.py), once
    plain (no mesh) and once lowered for a 1-D tensor-parallel mesh of all ranks (each argument read through
    its conversion, the op's form, the shard's shape check; the collectives themselves are priced as
    collectives), run forward and forward + backward; per node, ``fwd = (t_tp - t_plain) / nodes`` and
    ``bwd = ([t_tp(fb) - t_plain(fb)] - [t_tp - t_plain]) / nodes``."""
    import torch.distributed as dist

    from ..capture import graph_of
    from ..capture.export import run_export
    from ..codegen.compile import compile_rank
    from ..codegen.layers import layer_module
    from ..runtime.mesh import Mesh

    tp_group = Mesh(tp=nprocs).build(device.type).device_mesh["tp"].get_group()
    rows = 8 * nprocs
    model = _LayerMix(rows).to(device)
    example = torch.randn(2, 4, 8, device=device)
    program = run_export(model, (example,), None, train_mode=False)
    rank = compile_rank(_mix_plan(graph_of(model, program), nprocs), program, dist.get_rank(), model)
    compiled = rank.program
    split = compiled.split
    layers = [layer for chunk in rank.chunks for layer in chunk.layers]
    calls = [n for layer in layers for n in layer.spec.nodes]

    def variant(tp: bool) -> tuple[Callable[[], object], Callable[[], object]]:
        generated = [layer_module(layer.io(split.param_of), split.node_map, split.program.graph_module,
                                  compiled.lowered if tp else None, tp_group if tp else None, skip=compiled.skipped)
                     for layer in layers]
        x = torch.randn(2, 4, 8, device=device)
        w = torch.randn(rows, 8, device=device).requires_grad_()

        def forward() -> torch.Tensor:
            env = {split.user_inputs[0]: x}
            for layer, code in zip(layers, generated):
                params = [w for _ in (*layer.shared, *layer.own)]
                buffers = [split.buffer_value[b] for b in layer.spec.buffers]
                env.update(zip(layer.spec.outputs, code(*(env[v] for v in layer.spec.inputs), *params, *buffers)))
            return env[split.loss]

        def fwd_bwd() -> None:
            w.grad = None
            forward().backward()

        return forward, fwd_bwd

    (plain_fwd, plain_fb), (dt_fwd, dt_fb) = variant(False), variant(True)
    p_fwd, d_fwd, p_fb, d_fb = _per_call([plain_fwd, dt_fwd, plain_fb, dt_fb], device, 50)
    fwd = (d_fwd - p_fwd) / len(calls)
    bwd = ((d_fb - p_fb) - (d_fwd - p_fwd)) / len(calls)
    fwd, bwd = max_over_ranks([fwd, bwd], device)
    return max(0.0, fwd), max(0.0, bwd)
