"""The optimizer's step as a program runs it: partitioned over the gradient replicas under ZeRO-1
(:class:`Zero1Optimizer`), on fp32 masters of 16-bit weights, beside them or, when the plan offloads the
optimizer, on the host (:class:`MasterOptimizer`), compiled (:func:`compile_step`), on parts of tensors only
when its update is element-wise (:func:`steps_elementwise`), after its gradients are clipped by the whole
model's norm (:func:`clip_grad_norm_`).
The first two wrap the user's optimizer as an :class:`OptimizerWrapper`: a torch optimizer whose groups are the
user's, so that learning-rate schedulers built on the program's optimizer work under every plan.

A compiled program (``parallelize(..., compile=True)``, ``train.py --compile``) compiles its
optimizer's step as well as its chunks, as torch's "compiling the optimizer" recipe does:
inductor fuses the update (AdamW: weight decay, both moments, the bias corrections and the step,
about 8 tensor ops per parameter) into one kernel, a loop over each parameter. Eager, each of those
ops is a pass over memory and a dispatch: torch's default AdamW on a CPU is the single-tensor loop
(multi-tensor kernels are CUDA's). On a CPU the gain depends on the C allocator: eager, some ops make a
temporary of each parameter's size, and where glibc maps those afresh (page faults) the compiled step
takes under half the eager one's time; where it reuses heap memory, as a CPU rank's does
(host_heap.py), it gains 15-35% (BENCHMARKS.md, runtime overhead).

The step is compiled from its second call on: the first initialises the optimizer's state
(``torch.optim`` creates it lazily, inside ``step``), and a step compiled on the empty state would
be compiled again at once. It stays a bound method of the optimizer, so that user code calling
``optimizer.step()`` and learning-rate schedulers (which wrap ``optimizer.step.__func__``) run the
compiled step. A learning rate that changes is a float that dynamo does not specialise on
(``torch._dynamo.config.specialize_float``, False by default in torch 2.13), so a schedule costs one
recompile, not one a step (tests/unit/codegen/test_optim.py).

A plan that splits parameters (tensor parallelism, ZeRO-2/3's shards) has each rank step its parts of them, as
Megatron-LM's and FSDP2's optimizers do. That trains as one device does only for an optimizer whose update
of an element reads nothing but that element's gradient, state and the hyperparameters (SGD, Adam, AdamW,
Adagrad, RMSprop, ...). Muon (which orthogonalises a matrix's update), Adafactor (row and column statistics)
and LAMB (a trust ratio from each tensor's norms) step a part differently from the whole: on a half they
compute another update, with no error. No attribute of an optimizer says which kind it is, so
:func:`steps_elementwise` asks the factory's own optimizer: it steps a probe matrix and vector whole, and
in halves along each dimension, with the same gradients, and compares.

Clipping by the gradients' total norm (Megatron-LM's ``--clip-grad``, ``torch.nn.utils.clip_grad_norm_``)
reads every gradient: a rank holds parts of some (tensor-parallel splits, ZeRO shards, a pipeline stage's
layers) and copies of others (replicated over tp, over the data-parallel replicas, tied over stages), so
the torch function on a rank's parameters computes another norm on each rank and scales each by another
factor. :func:`clip_grad_norm_` takes each of the rank's gradients with whether this rank counts it (the
program decides, so that every element of the model counts once over all ranks), sums the counted
``|g|^p`` over every rank in one all-reduce (the max for ``p = inf``) and scales every gradient alike, as
Megatron-LM's ``clip_grad_norm_fp32`` counts a tensor-parallel replica on one rank only.

Imports only torch, buckets.py, data_parallel.py, errors.py and failures.py: the standalone folder (standalone.py)
carries this file beside its train.py.
"""

from __future__ import annotations

import math
import types
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .buckets import dp_bucket_bytes
from .data_parallel import bucket_runs, local, lone
from .errors import ConfigError
from .failures import start, wait_or_fail


def compile_step(optimizer: torch.optim.Optimizer, backend: str | Callable[..., Any]) -> None:
    """Replace ``optimizer.step`` by itself compiled with ``backend`` (a torch.compile backend), from its
    second call on."""
    eager = optimizer.step
    compiled = torch.compile(eager, backend=backend)
    calls = 0

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return (eager if calls == 1 else compiled)(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)


class OptimizerWrapper(torch.optim.Optimizer):
    """An optimizer around the user's (``inner``, None on a ZeRO-1 rank that owns nothing), whose ``param_groups``,
    ``state`` and ``defaults`` are the inner one's very objects: a learning-rate scheduler built on the program's
    optimizer sets the inner one's rates (torch's schedulers take only a ``torch.optim.Optimizer``, and read and
    write its groups). Not initialised as one: it holds no parameters of its own, and torch refuses an optimizer
    of none."""

    def __init__(self, inner: torch.optim.Optimizer | None) -> None:   # noqa: super().__init__ not called (above)
        self.inner = inner
        self.defaults = inner.defaults if inner is not None else {}
        self.state = inner.state if inner is not None else defaultdict(dict)
        self.param_groups = inner.param_groups if inner is not None else []
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())   # what torch.optim.Optimizer's own methods read


class MasterOptimizer(OptimizerWrapper):
    """The user's optimizer over fp32 master copies of the 16-bit tensors it steps, as mixed-precision training
    keeps them (``Precision.master_weights``, priced in the states' bytes): beside them on the device (``host``
    False), or, with the states and the step, in host memory (``host``: ``offload="optimizer"``,
    cost_model/offload.py, as DeepSpeed's ``offload_optimizer`` and Megatron-LM's ``--optimizer-cpu-offload`` run
    it). Without masters a 16-bit AdamW rounds away every update below half a unit in the weight's last place
    (bf16 keeps 8 bits: an update under 0.4% of the weight), so a bf16 model stepped as it is trains otherwise
    than the mixed precision a plan prices.

    ``params`` are what the program's optimizer steps on the device (parameters, FSDP2's sharded DTensors,
    or tensor-parallel local shards: their local data is copied); ``factory`` builds the real optimizer over
    the masters (``inner``): fp32 where ``master_weights`` and the tensor is 16-bit, else in its own dtype (on
    the device: the tensor itself, stepped in place). Each :meth:`step` gives every master its gradient
    (converted; on the host after the copy), steps ``inner``, and copies each updated master back, converted
    to the device's dtype (on the host first: the bytes the cost model prices over the host link). On a CPU
    device the gradient is already in host memory (no copy when the dtypes agree); the host master is a copy
    all the same, so that the step runs as on a GPU. Checkpoints see ``inner`` over the masters (:meth:`stepped`
    names them), which have the local shape of what they copy; :meth:`reload` refreshes them after the device
    tensors are loaded."""

    def __init__(self, params: Any, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 master_weights: bool = True, host: bool = True) -> None:
        self.params = list(params)
        pin = torch.cuda.is_available()
        self.masters: list[torch.Tensor] = []
        self.aliased: list[bool] = []   # on the device and not widened: the tensor itself
        for p in self.params:
            data = local(p).detach()
            wide = master_weights and data.is_floating_point() and data.element_size() < 4
            if not host and not wide:
                master = data
            else:
                master = torch.empty(data.shape, dtype=torch.float32 if wide else data.dtype,
                                     device="cpu" if host else data.device,
                                     pin_memory=host and pin and data.device.type != "cpu")
                master.copy_(data)
            self.masters.append(master)
            self.aliased.append(master is data)
        self._master = {id(p): m for p, m in zip(self.params, self.masters)}
        super().__init__(factory(self.masters))

    @staticmethod
    def needed(params: Iterable[torch.Tensor], master_weights: bool) -> bool:
        """Whether stepping ``params`` on the device needs masters: ``master_weights`` and a 16-bit one."""
        return master_weights and any(local(p).is_floating_point() and local(p).element_size() < 4 for p in params)

    def stepped(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (fqn -> what the program steps) with each tensor this optimizer copies replaced by its
        master (what ``inner`` steps: the names a checkpoint gives its state)."""
        return {fqn: self._master.get(id(t), t) for fqn, t in tensors.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in (*self.params, *self.masters):
            t.grad = None if set_to_none or t.grad is None else t.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            grad = p.grad
            master.grad = None if grad is None else local(grad).to(master.device).to(master.dtype)
        self.inner.step()
        for p, master, aliased in zip(self.params, self.masters, self.aliased):
            if not aliased:
                data = local(p)
                data.copy_(master.to(data.dtype))
                master.grad = None

    def copies(self, stepped: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """fqn -> master of :meth:`stepped`'s names that are copies (not the tensor itself): what a checkpoint saves
        beside the weights (dcp_state's ``master.<fqn>``)."""
        mine = {id(m) for m, aliased in zip(self.masters, self.aliased) if not aliased}
        return {fqn: t for fqn, t in stepped.items() if id(t) in mine}

    @torch.no_grad()
    def reload(self, only: Iterable[torch.Tensor] | None = None) -> None:
        """Refresh the masters (those of ``only``, default all) from the device tensors (after a checkpoint filled
        those without their masters)."""
        keep = None if only is None else {id(t) for t in only}
        for p, master, aliased in zip(self.params, self.masters, self.aliased):
            if not aliased and (keep is None or id(master) in keep):
                master.copy_(local(p))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()


PROBE_SHAPES = ((8, 6), (6,))   # a matrix and a vector (Muon takes matrices only; a factory may sort by ndim)
PROBE_STEPS = 3                 # the third reads states two steps wrote
PROBE_TOLERANCE = 1e-4          # of the largest update: element-wise kernels agree to rounding whatever the split


def steps_elementwise(factory: Callable[[list[torch.Tensor]], Any], device: torch.device | str = "cpu"
                      ) -> tuple[bool | None, str]:
    """Whether the optimizers ``factory`` builds step each element alone: ``(True, "")``, ``(False, how the
    parts' update differs)``, or ``(None, why it could not tell)`` where the factory or its step fails on
    the probe's fp32 tensors on ``device`` (it wants parameters of its own, or a closure).

    The probe (module docstring): :data:`PROBE_SHAPES` (or, where the factory refuses the vector, the matrix
    alone) stepped :data:`PROBE_STEPS` times whole, then split in
    halves along dim 0 and along dim 1 (the vector along its one dim), with the same seeded gradients; an
    element-wise optimizer gives each half of what the whole got."""
    failed = ""
    for shapes in (PROBE_SHAPES, PROBE_SHAPES[:1]):   # then the matrix alone, for an optimizer of matrices only
        try:
            return _probe(factory, device, shapes)
        except Exception as exc:  # noqa: BLE001 - any failure of a user's factory means: cannot tell
            failed = failed or f"{type(exc).__name__}: {exc}"
    return None, failed


def _probe(factory: Callable[[list[torch.Tensor]], Any], device: torch.device | str,
           shapes: tuple[tuple[int, ...], ...]) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(PROBE_STEPS)]

    def stepped(dim: int | None) -> list[torch.Tensor]:
        def parts(t: torch.Tensor) -> list[torch.Tensor]:
            return [t] if dim is None else list(t.chunk(2, min(dim, t.ndim - 1)))
        params = [torch.nn.Parameter(part.clone().to(device)) for t in initial for part in parts(t)]
        optimizer = factory(params)
        for step in grads:
            for p, g in zip(params, [part for t in step for part in parts(t)]):
                p.grad = g.clone().to(device)
            optimizer.step()
        out, k = [], 0
        for t in initial:
            n = len(parts(t))
            out.append(torch.cat([p.detach().cpu() for p in params[k:k + n]], min(dim or 0, t.ndim - 1)))
            k += n
        return out

    whole = stepped(None)
    split = {dim: stepped(dim) for dim in (0, 1)}
    moved = max(float((w - s).abs().max()) for w, s in zip(whole, initial))
    for dim, got in split.items():
        worst = max(float((g - w).abs().max()) for g, w in zip(got, whole))
        if worst > PROBE_TOLERANCE * max(moved, 1e-12):
            return False, (f"stepped in halves along dim {dim}, a probe tensor moved up to {worst:.2g} away from "
                           f"where stepping it whole took it (moves of up to {moved:.2g})")
    return True, ""


def norm_pieces(params: Mapping[str, torch.Tensor], first_holder: Callable[[str], bool], tp_split: Callable[[str], bool],
                tp_rank: int, reducers: Sequence[Any]) -> list[tuple[torch.Tensor, bool]]:
    """For :func:`clip_grad_norm_`: each gradient of ``params`` (fqn -> parameter) this rank holds (its local
    data), with whether this rank counts it, so that every element of the model counts on one rank: on the
    first pipeline stage that holds it (``first_holder``; tied weights are summed over their stages); a
    tensor-parallel split (``tp_split``) on every tp rank, a replicated one on tp rank 0; over its gradient
    replicas, on the rank holding its mean (``reducers``: ZeRO-1's owner, else the group's first rank:
    GradReducer.counted), and on every rank under ZeRO-2/3 (no reducer: FSDP2's shards are disjoint)."""
    pieces, seen = [], set()
    for fqn, p in params.items():
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        replica = next((c for c in (r.counted(p) for r in reducers) if c is not None), True)
        pieces.append((local(p.grad), first_holder(fqn) and (tp_split(fqn) or tp_rank == 0) and replica))
    return pieces


def check_clip(max_norm: float, norm_type: float) -> None:
    if not max_norm > 0 or not norm_type > 0:
        raise ConfigError(f"clipping the gradients needs max_norm > 0 and norm_type > 0 (inf for the largest element), "
                          f"got max_norm={max_norm}, norm_type={norm_type}")


def clip_grad_norm_(pieces: list[tuple[torch.Tensor, bool]], max_norm: float, norm_type: float, timeout: float
                    ) -> torch.Tensor:
    """Scale this rank's gradients (``(gradient, counted here)``; module docstring) so that the model's total
    ``norm_type``-norm is at most ``max_norm``; returns that norm (fp32, the same on every rank), as
    ``torch.nn.utils.clip_grad_norm_`` on one device: scale ``max_norm / (norm + 1e-6)`` where below 1.
    Collective over every rank of the default group."""
    check_clip(max_norm, norm_type)
    grads = list({id(g): g for g, _ in pieces}.values())
    device = grads[0].device if grads else torch.device("cpu")
    inf = math.isinf(norm_type)
    norms = [n.float() for same in _by_kind([g for g, here in pieces if here and g.numel()]).values()
             for n in torch._foreach_norm(same, norm_type)]   # each in its gradient's dtype, as torch's
    total = torch.zeros((), dtype=torch.float32, device=device)
    if norms:
        stacked = torch.stack(norms)
        total = stacked.max() if inf else stacked.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    wait_or_fail(start(dist.all_reduce, total, op=op, async_op=True), timeout, "all_reduce of the gradients' norm")
    norm = total if inf else total.pow(1.0 / norm_type)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for (where, dtype), same in _by_kind(grads).items():
        torch._foreach_mul_(same, scale.to(where, dtype))
    return norm


def _by_kind(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``tensors`` by device and dtype: a foreach kernel takes one of each."""
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


class Zero1Optimizer(OptimizerWrapper):
    """ZeRO stage 1: each rank keeps optimizer state for its share of the parameters (whole tensors,
    greedily balanced by size, as ZeroRedundancyOptimizer partitions, so that any optimizer steps them as
    one device does), steps only those, then every owner broadcasts its updated parameters to the others:
    flattened, in buckets of the gradients' size (buckets.dp_bucket_bytes) per owner and dtype, one
    broadcast each (the cost model prices the gather in such buckets), two in flight at a time (a
    bucket's flat copy is all the memory it takes beyond the weights; a tensor alone in its bucket, one
    larger than a bucket, is sent from and received into itself, with no copy).

    ``partitions`` is a list of ``(params, group, ranks)``: the parameters reduced over one group
    (``ranks``: its global ranks by group rank; a group of one rank, or None, owns everything).
    The optimizer factory is called once, over this rank's share of every partition."""

    def __init__(self, partitions: Sequence[tuple[Sequence[nn.Parameter], object, Sequence[int]]],
                 factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], rank: int,
                 timeout: float) -> None:
        self.timeout, self.rank = timeout, rank
        self.params: list[nn.Parameter] = []
        self.sources: list[tuple[nn.Parameter, int, object]] = []   # (param, owner's global rank, group)
        self.mine: list[nn.Parameter] = []
        # the broadcasts after the step: (parameters, their owner's global rank, group), the same list on every rank
        self.sends: list[tuple[list[nn.Parameter], int, object]] = []
        for params, group, ranks in partitions:
            ranks = list(ranks)
            load = [0] * len(ranks)
            owner: dict[int, int] = {}
            for i in sorted(range(len(params)), key=lambda i: -local(params[i]).numel()):
                k = min(range(len(load)), key=lambda j: (load[j], j))
                load[k] += local(params[i]).numel()
                owner[i] = k
            for i, p in enumerate(params):
                self.params.append(p)
                if ranks[owner[i]] == rank:
                    self.mine.append(p)
                if len(ranks) > 1:
                    self.sources.append((p, ranks[owner[i]], group))
            if len(ranks) > 1:
                for k, src in enumerate(ranks):
                    owned = [p for i, p in enumerate(params) if owner[i] == k and local(p).numel()]
                    if owned:
                        limit = dp_bucket_bytes(len(ranks), local(owned[0]).element_size())
                        self.sends.extend((run, src, group) for run in bucket_runs(owned, limit))
        super().__init__(factory(self.mine) if self.mine else None)

    def owners(self, params: Mapping[str, nn.Parameter], keep_all: Iterable[str] = ()) -> dict[int, int]:
        """For :meth:`GradReducer.reduce_to_owners`: id(parameter) -> the global rank that steps it, for the
        parameters of ``params`` (fqn -> parameter, whose local data this optimizer steps) but those of
        ``keep_all``, whose summed gradient every rank needs (more reductions follow)."""
        skip, owner = set(keep_all), {id(p): src for p, src, _ in self.sources}
        return {id(p): owner[id(local(p))] for fqn, p in params.items() if fqn not in skip and id(local(p)) in owner}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        pending: list[tuple[Any, torch.Tensor, list[torch.Tensor], bool, object]] = []
        for params, src, group in self.sends:
            datas = [local(p.data) for p in params]
            flat = lone(datas)   # a tensor alone: sent from and received into itself
            copy = flat is None and src != self.rank
            if flat is None:
                flat = (_flatten_dense_tensors(datas) if src == self.rank else
                        torch.empty(sum(d.numel() for d in datas), dtype=datas[0].dtype, device=datas[0].device))
            pending.append((start(dist.broadcast, flat, src=src, group=group, async_op=True), flat, datas, copy, group))
            if len(pending) > 1:
                self._received(*pending.pop(0))
        for item in pending:
            self._received(*item)

    def _received(self, work: Any, flat: torch.Tensor, datas: list[torch.Tensor], copy: bool, group: object) -> None:
        wait_or_fail(work, self.timeout, "broadcast of ZeRO-1 updated parameters", group)
        if copy:
            torch._foreach_copy_(datas, _unflatten_dense_tensors(flat, datas))

    def state_dict(self):
        return self.inner.state_dict() if self.inner is not None else {}


def wrapped(optimizer: Any, kind: type) -> Any:
    """The first ``kind`` down a program's optimizer and the ones it wraps (``inner``: ZeRO-1's partition,
    MasterOptimizer's host copies), or None."""
    while optimizer is not None and not isinstance(optimizer, kind):
        optimizer = getattr(optimizer, "inner", None)
    return optimizer


def innermost(optimizer: Any) -> torch.optim.Optimizer | None:
    """The user's optimizer under a program's (the wrappers' ``inner``), or None."""
    while isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.inner
    return optimizer
