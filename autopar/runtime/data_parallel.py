"""Data-parallel gradient reduction (bucketed, overlapped with backward) and ZeRO-1.

ZeRO-2 and ZeRO-3 are FSDP2's ``fully_shard`` (assembly.py, through :func:`shard_unit`). Plain
data parallelism and ZeRO-1 are done here rather than by ``DistributedDataParallel`` / ``ZeroRedundancyOptimizer``:

- DDP wraps one module with one forward per backward; a pipeline rank runs several chunk
  modules, each several micro-batches, and only the *last* backward of each chunk in a step
  may start the reduction. DDP also refuses DTensor (tensor-parallel) parameters.
- ``ZeroRedundancyOptimizer`` wants an optimizer class and keyword arguments and broadcasts
  whole tensors, not DTensor shards; ours takes the user's optimizer factory.

:class:`GradReducer` puts parameters into buckets of ``buckets.dp_bucket_bytes`` (DDP's 25 MB,
grown with the group's size as Megatron-Core grows its buckets; the cost model prices the same
buckets) in reverse registration
order (about the order backward finishes them, as DDP does) and starts one asynchronous
all-reduce (sum) per bucket as soon as the last gradient of the bucket is accumulated during
the chunk's final backward (a hook on each of its parameters); the chunk's last bucket, which
only the end of that backward completes, starts when the backward returns
(:meth:`GradReducer.ended`), with no hooks: a chunk whose parameters fit one bucket runs no
Python per parameter until the all-reduce. A started bucket's gradients are flattened into one
buffer and each becomes a view of it (DDP's ``gradient_as_bucket_view``): no gradient is held twice
while the step's collectives finish (the cost model prices one copy of the gradients and the bucket
being flattened). :meth:`GradReducer.finish` waits and divides each buffer in place by ``divisor``,
the number of ranks whose losses the gradient averages (``dp * cp``), which is the group's size for
dense weights; expert weights are summed over their expert replicas only (``dp * cp / ep`` ranks, or
none) and still divided by ``dp * cp`` (expert_parallel.py explains why).

ZeRO-1's optimizer (optim.py's ``Zero1Optimizer``) partitions each group of parameters over the ranks that
reduce its gradients (dense weights over ``dp * cp``, expert weights over their expert replicas) and runs
the user's optimizer once over this rank's share of all groups. Its reducers then sum each gradient
onto its owner only (:meth:`GradReducer.reduce_to_owners`: a reduce per owner and bucket, the traffic of
DeepSpeed's ZeRO-1 with contiguous gradients (0.13 on), which the cost model prices as a reduce-scatter); the other ranks then free their parts
of that gradient, which nothing reads (:meth:`GradReducer.share` sends them the mean when asked), and
after the step each owner broadcasts what it stepped, a bucket at a time (an all-gather's traffic,
priced after the step: ``Precision.param_gather``).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from .buckets import dp_bucket_bytes
from .failures import start, wait_or_fail
from .errors import ConfigError


def shard_unit(module: nn.Module | list[nn.Module], offload: bool = False, fp8: bool = False, **kwargs) -> None:
    """``fully_shard(module, **kwargs)``, leaving out the parameters with no elements; ``offload``: its shards of
    the parameters, their gradients and (so) the optimizer states in host memory (FSDP2's ``CPUOffloadPolicy``,
    pinned where a GPU copies from them; ParallelConfig.offload); ``fp8``: the program gathers weights in fp8
    (fp8.gather_bytes: as bytes where the backend has no fp8 type).

    FSDP2 cannot reduce-scatter an empty gradient (torch 2.13: "_chunk_cat expects non-empty
    tensor" at the first backward): a parameter with no elements (MobileBERT's 0 x 256 dense when
    its hidden size equals its embedding size) has nothing to shard, gather or average, so it stays
    a plain parameter of every rank (``ignored_params``, torch >= 2.7)."""
    from torch.distributed.fsdp import fully_shard
    modules = module if isinstance(module, list) else [module]
    empty = {p for m in modules for p in m.parameters() if p.numel() == 0}
    if empty:
        import inspect
        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            names = [n for m in modules for n, p in m.named_parameters() if p in empty]
            raise ConfigError(f"ZeRO-2/3 of a model with parameters of no elements ({', '.join(names[:3])}) needs "
                              f"torch >= 2.7 (fully_shard's ignored_params; this is {torch.__version__}): upgrade "
                              f"torch, or plan with zero <= 1")
        kwargs["ignored_params"] = empty
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    fully_shard(module, **kwargs)
    if fp8:
        from .fp8 import gather_bytes
        gather_bytes(modules[0])   # the unit's modules share one FSDP2 state


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of a (possibly distributed) tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dedupe(per_chunk: list[list[nn.Parameter]], ends: Sequence[int] | None = None) -> list[list[nn.Parameter]]:
    """A parameter shared by two chunks of this rank is reduced once, with the chunk whose last backward of the
    step comes last (its gradient is complete only then): ``ends[k]``, the position of chunk ``k``'s last
    backward among the rank's actions (pipeline.backward_ends); by default the earlier chunk (a looped
    placement's earlier chunk ends its backward last)."""
    seen: set[int] = set()
    out: list[list[nn.Parameter]] = [[] for _ in per_chunk]
    order = range(len(per_chunk)) if ends is None else sorted(range(len(per_chunk)), key=lambda k: -ends[k])
    for c in order:
        for p in per_chunk[c]:
            if id(p) not in seen:
                seen.add(id(p))
                out[c].append(p)
    return out


def all_reduce_grads(items: Sequence[tuple[str, nn.Parameter, object]], timeout: float) -> None:
    """Sum each ``(what, parameter, group)``'s gradient over its group (a replicated parameter whose gradient
    each tensor-parallel rank holds a part of; a parameter several pipeline stages hold), every all-reduce
    started before the first is waited on; a parameter without a gradient contributes zeros. Under FSDP2 or
    tensor parallelism, this rank's data of the gradient."""
    works = []
    for what, p, group in items:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append((start(dist.all_reduce, local(p.grad), group=group, async_op=True), what, group))
    for work, what, group in works:
        wait_or_fail(work, timeout, f"all_reduce of {what}", group)


class _Part:
    """One collective of a started bucket: the gradients of ``params`` (and the ``carried`` values) flattened into
    ``flat``, summed onto rank ``dst`` (a global rank: ZeRO-1's owner of those parameters) or, ``dst`` None, onto
    every rank of the group. From then on each gradient is a view of ``flat`` (its own tensor freed), so a
    bucket's gradients are never held twice while the step's collectives finish (DDP's
    ``gradient_as_bucket_view``); a gradient alone in its part is reduced as it is, with no copy. ``copy_back``
    lists what is not a view (the carried values, a gradient of a distributed parameter), into which
    :meth:`GradReducer.finish` writes the sums."""

    def __init__(self, params: list[nn.Parameter], dst: int | None, group,
                 carried: torch.Tensor | None = None) -> None:
        self.params, self.dst = params, dst
        grads = [local(p.grad) for p in params] + ([carried] if carried is not None else [])
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.flat, views = lone(grads), []
        if self.flat is None:
            self.flat = _flatten_dense_tensors(grads)
            views = _unflatten_dense_tensors(self.flat, grads)
        for i, view in enumerate(views):
            if i < len(params) and not isinstance(params[i].grad, DTensor):
                params[i].grad = view
            else:
                self.copy_back.append((grads[i], view))
        if group is None:
            self.work = _Done()
        elif dst is None:
            self.work = start(dist.all_reduce, self.flat, group=group, async_op=True)
        else:
            self.work = start(dist.reduce, self.flat, dst=dst, group=group, async_op=True)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready: set[int] = set()
        self.parts: list[_Part] | None = None         # its collectives, once started
        self.carried: torch.Tensor | None = None   # values summed with this bucket's gradients (GradReducer.carry)


class GradReducer:
    """Bucketed all-reduce (sum) of the gradients of some chunks' parameters over ``group``, then a
    division by ``divisor``; ``group`` None (a parameter held by one rank only) just divides. Under ZeRO-1
    (:meth:`reduce_to_owners`) a parameter's gradient is summed onto the rank that steps it only, as
    DeepSpeed's ZeRO-1 reduces: a reduce-scatter's traffic rather than an all-reduce's twice that."""

    def __init__(self, chunks: Sequence[Sequence[nn.Parameter]], group, divisor: int, timeout: float,
                 bucket_bytes: int | None = None) -> None:
        self.group = group
        self.size = divisor
        self.timeout = timeout
        self.active: set[int] = set()
        self.buckets: list[list[_Bucket]] = []
        self._where: dict[int, tuple[int, _Bucket]] = {}
        self._handles = []
        self.owners: dict[int, int] = {}   # id(parameter) -> the global rank its gradient is summed onto
        self.rank = dist.get_rank() if group is not None else 0
        # the last step's parameters whose gradients were summed onto an owner, by part (their owner), in the
        # order issued: the parameters, not their gradients, which the next step's zero_grad must free
        self.reduced: list[tuple[list[nn.Parameter], int]] = []
        if bucket_bytes is None:
            first = next((p for ps in chunks for p in ps), None)
            ranks = dist.get_world_size(group) if group is not None else 1
            bucket_bytes = dp_bucket_bytes(ranks, local(first).element_size() if first is not None else 4)
        for c, params in enumerate(chunks):
            buckets = [_Bucket(b) for b in bucket_runs([p for p in reversed(list(params)) if p.requires_grad],
                                                        bucket_bytes)]
            self.buckets.append(buckets)
            for b in buckets[:-1]:   # the last starts when the backward ends (ended)
                for p in b.params:
                    self._where[id(p)] = (c, b)
                    self._handles.append(p.register_post_accumulate_grad_hook(_weak_hook(weakref.ref(self))))
        self.reduced_ids = frozenset(id(p) for buckets in self.buckets for b in buckets for p in b.params)
        # the hooks live as long as the parameters (the caller's model may keep them); a hook holding
        # this reducer would keep it, and with it its process group (a gloo group's thread polls every
        # 10 ms), alive after the program is gone: they hold it weakly, and are removed with it
        weakref.finalize(self, _remove_all, self._handles)

    def reduce_to_owners(self, owners: Mapping[int, int]) -> None:
        """ZeRO-1: sum the gradient of each parameter in ``owners`` (id -> global rank of the group) onto that
        rank alone, the one whose optimizer steps it; after :meth:`finish` the other ranks hold no gradient
        of it (:meth:`share` sends them the mean). Parameters not in ``owners`` are still
        all-reduced: those whose sum more reductions follow (a tensor-parallel partial gradient, a tied
        parameter's), which every rank must hold. Every rank of the group passes the same ``owners``."""
        self.owners = {i: r for i, r in owners.items() if i in self.reduced_ids}

    def counted(self, p: torch.Tensor) -> bool | None:
        """Whether this rank's gradient of ``p``, after :meth:`finish`, is the one a norm over the group's ranks
        counts (each element once): the owner's under ZeRO-1 (the others hold none after finish, or the mean
        after share), else the group's first rank's (every rank holds the mean). None when ``p`` is not reduced here."""
        if id(p) not in self.reduced_ids:
            return None
        if id(p) in self.owners:
            return self.owners[id(p)] == self.rank
        return self.group is None or dist.get_rank(self.group) == 0

    def share(self) -> None:
        """Send every rank the means :meth:`finish` left on their owners (``full_grads``, which reads every
        gradient on every rank). Collective over the group, after :meth:`finish`."""
        works = []
        for params, dst in self.reduced:
            if dst == self.rank:
                grads = [local(p.grad) for p in params]
                flat = lone(grads)
                flat = _flatten_dense_tensors(grads) if flat is None else flat
            else:   # finish freed this rank's parts of them
                flat = torch.empty(sum(local(p).numel() for p in params), dtype=local(params[0]).dtype,
                                   device=local(params[0]).device)
            works.append((params, dst, flat, start(dist.broadcast, flat, src=dst, group=self.group, async_op=True)))
        for params, dst, flat, work in works:
            wait_or_fail(work, self.timeout, "broadcast of ZeRO-1 reduced gradients", self.group)
            if dst != self.rank:
                for p, view in zip(params, _unflatten_dense_tensors(flat, [local(p) for p in params])):
                    if isinstance(p, DTensor):
                        p.grad = torch.zeros_like(p)
                        local(p.grad).copy_(view)
                    else:
                        p.grad = view
        self.reduced = []

    def carry(self, values: torch.Tensor) -> bool:
        """Sum ``values`` over the group in the same collective as the step's last bucket (that of the
        earliest parameters, the last backward finishes), rather than in a collective of their own:
        :meth:`finish` writes the sums back into ``values``, undivided. False (nothing carried) when
        that bucket's gradients are not of ``values``' dtype, whose sums a cast would round. Called
        after the step's last forward, before the backward that completes that bucket, on every rank
        of the group alike."""
        bucket = next((buckets[-1] for buckets in self.buckets if buckets), None)
        if bucket is None or local(bucket.params[0]).dtype != values.dtype:
            return False
        if bucket.parts is not None:
            raise RuntimeError("GradReducer.carry after its last bucket's all-reduce started: call it after the "
                               "step's last forward, before its last backward")
        bucket.carried = values
        return True

    def start(self, chunk: int) -> None:
        """The next backward of ``chunk`` is its last in this step: reduce as gradients finish."""
        self.active.add(chunk)

    def ended(self, chunk: int) -> None:
        """``chunk``'s last backward of the step returned: every gradient of its buckets is complete;
        start those not started (its last bucket, and any whose parameters got no gradient)."""
        for bucket in self.buckets[chunk]:
            if bucket.parts is None:
                self._launch(bucket)

    def _hook(self, p: torch.Tensor) -> None:
        c, bucket = self._where[id(p)]
        if c in self.active and bucket.parts is None:
            bucket.ready.add(id(p))
            if len(bucket.ready) == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        by_dst: dict[int | None, list[nn.Parameter]] = {}   # all-reduced (None) first, then each owner's
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dst.setdefault(self.owners.get(id(p)), []).append(p)
        if bucket.carried is not None:
            by_dst.setdefault(None, [])
        bucket.parts = [_Part(params, dst, self.group, bucket.carried if dst is None else None)
                        for dst, params in sorted(by_dst.items(), key=_all_first)]

    def finish(self) -> None:
        """Wait for every bucket (starting those not started), write the mean gradients back (and the
        carried values' sums); under ZeRO-1 the means of the gradients this rank owns only."""
        self.reduced = []
        for buckets in self.buckets:
            for bucket in buckets:
                if bucket.parts is None:
                    self._launch(bucket)
                for part in bucket.parts:
                    wait_or_fail(part.work, self.timeout, "reduction of data-parallel gradients", self.group)
                    if part.dst is not None:
                        self.reduced.append((part.params, part.dst))
                        if part.dst != self.rank:   # the owner holds the sum (share); this rank's part of it,
                            for p in part.params:   # which nothing reads, is freed (as DeepSpeed's ZeRO-1 frees it)
                                p.grad = None
                            continue
                    carried = bucket.carried.numel() if bucket.carried is not None and part.dst is None else 0
                    part.flat[:part.flat.numel() - carried].div_(self.size)
                    if part.copy_back:   # in one op (a copy of each from Python was host time per parameter)
                        torch._foreach_copy_(*map(list, zip(*part.copy_back)))
                bucket.parts, bucket.carried = None, None
                bucket.ready.clear()
        self.active.clear()


def _weak_hook(reducer: "weakref.ref[GradReducer]") -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        live = reducer()
        if live is not None:
            live._hook(p)
    return hook


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _all_first(item: tuple[int | None, list]) -> tuple[int, int]:
    """The all-reduced part first (the carried values ride it), then the owners' in rank order: every rank of
    the group issues the bucket's collectives in one order."""
    return (0, 0) if item[0] is None else (1, item[0])


class _Done:
    """The work of a reduction over one rank: nothing to wait for."""

    def wait(self, timeout=None) -> bool:
        return True


def lone(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A collective's buffer for ``tensors`` without a copy: the tensor itself, flat, when it is alone and contiguous
    (one larger than a bucket); else None (flatten them)."""
    return tensors[0].view(-1) if len(tensors) == 1 and tensors[0].is_contiguous() else None


def bucket_runs(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into runs of at most ``bucket_bytes`` (a larger tensor alone) of one dtype and
    device (one flat buffer holds each run): the gradient buckets, and ZeRO-1's broadcasts after the step."""
    runs: list[list[nn.Parameter]] = []
    size, kind = 0, None
    for p in params:
        data = local(p)
        nbytes = data.numel() * data.element_size()
        if not runs or (data.dtype, data.device) != kind or size + nbytes > bucket_bytes:
            runs.append([])
            size, kind = 0, (data.dtype, data.device)
        runs[-1].append(p)
        size += nbytes
    return runs
