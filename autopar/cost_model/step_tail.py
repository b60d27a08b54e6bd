"""What a step pays once, after its pipeline: gradient synchronisation, the loss's all-reduce, the optimizer.

``T_step = T_pipe + T_dp_exposed + T_opt`` (estimator.py); this module prices the last two terms.

Data parallelism runs over the ``dp * cp`` ranks holding the same dense weights (context-
parallel ranks see different tokens of the same sequences, so their gradients are reduced
together, as Megatron-Core does), expert weights over the ``dp * cp / ep`` ranks holding the
same experts (expert_parallel.py); ZeRO shards over the same groups. Gradients (ZeRO 0-1) are
all-reduced (ZeRO 1: reduce-scattered, or all-reduced where the program does, ``Precision.grad_reduce``:
DeepSpeed 0.4.4-0.12's stage 1) once per step in buckets (``runtime.buckets.dp_bucket_bytes``: DDP's
25 MB, grown with the group as Megatron-Core grows them, one collective and one ring latency each) that
overlap the backward pass of the last micro-batch. ZeRO-1 then all-gathers the updated weights in the same
buckets: after the optimizer step, with nothing beside it (``Precision.param_gather`` "after_step", what
``parallelize``, DeepSpeed and Megatron-Core's default run), or under the next step's first forward
("overlapped": Megatron-Core's ``--overlap-param-gather``), hidden as the reduction is, with ``F`` for
``B_last``. With ``o`` the fraction of a
collective's time that compute issued meanwhile hides (``Link.overlap``: 1 for NCCL, measured
for gloo, whose threads share the CPU cores) times ``1 - k``, where ``k`` is the compute the
overlapped collective slows down per second of it (``Device.overlap_slowdown``: its kernels take
SMs and memory bandwidth), what is exposed is
``T_dp - o * min(B_last, T_dp - T_last)`` (the last bucket never hides; with
``o = 1`` this is ``max(T_dp - B_last, T_last)``), where ``T_last = max(T_dp / n_buckets, T(lead))``: a bucket
never splits a tensor, and the tensor the backward completes last is the one its forward reads first
(``ParamTables.lead_params``: the token embedding on a language model's first stage, as large as a block's
weights), so the last bucket holds at least it. ZeRO-1's gather under the next forward needs that tensor first:
its first bucket is at least the lead tensor's gather alike.
ZeRO 3 gathers each unit's weights in forward and again in backward (``T_ag'``: all but the kept
units: the chunk's root, which holds the runs outside the repeated block too small for a unit of
their own, and the model's last unit, the final norm and head, whose backward follows its forward at
once; both stay gathered in between, as FSDP2 keeps its root and torchtitan wraps the head) and
reduce-scatters its gradients (one collective per unit: each repeated block, each large run of the
other layers, the root; ModelStructure.shard_units, as the runtime wraps them), for every micro-batch,
prefetched under compute: exposed ``T_ag - o_f min(T_ag, F) + T_ag' + T_rs - o min(T_ag' + T_rs, B)``
per micro-batch, plus the hidden share of the first unit's gather, which nothing hides, and of the last
unit's reduce-scatter (an equal unit's share, or the lead tensor's collectives where larger: the unit holding
it), which FSDP2 issues when the step's last backward has ended, with no compute left to hide it (the
optimizer waits for it): prefetching one unit ahead, as FSDP2 does, hides each unit's collectives behind its
neighbour's compute, never the step's first gather or last reduction.
ZeRO 2 (FSDP2 without resharding after forward, and none between the step's micro-batches, as
the runtime runs it) gathers each unit's weights once per step, under the first forward, and
reduce-scatters its gradients after every backward, so that only a shard of them is ever held:
``T_ag - o_f min(T_ag, F)`` plus ``T_rs - o min(T_rs, B)`` per micro-batch, plus the first gather and
the last reduce-scatter.
FSDP2 copies around each unit's collectives (torch.distributed.fsdp's _fsdp_collectives.py), each a memory-bound
pass (read and written) of one kernel a unit, for ``N`` parameters gathered or reduced over ``d`` ranks: before a
gather, the shards into one flat buffer (``2 w_b N / d``, on the gather's own stream: part of ``T_ag``, hidden
as it is); after it, that buffer into the unsharded parameters (``2 w_b N``, copy-out) and, before a
reduce-scatter, the unsharded gradients into its flat input in the reduce dtype (``(w_b + g_b) N``), both on
the compute stream: exposed, per gather and per reduce-scatter.
Forward prefetch (``o_f = o``) needs a host that runs ahead of its device, as with GPU
streams; on a CPU the compute runs on the thread that would issue the next gather
(FSDP2 prefetches explicitly only in backward), so ``o_f = 0`` there.

When the losses are not all on every rank already (data or pipeline or context parallelism), the
runtime all-reduces them (a few floats) over every device once per step, counted with
``T_dp_exposed``. Each rank starts it after its last forward of the step (the rank computing the
losses has them all by then), so that it runs under the backward passes left: exposed
``T_ar - o min(T_ar, B_last)`` with ``B_last`` the backward that follows the last loss on its stage
(one micro-batch of the last chunk; on the stages before it, more backward follows still).

The optimizer step streams the local shard's weights, gradients and states through
memory once: ``Psi_local (2 K + g + w) / (W e_mem)``; profiled, it is the measured seconds
per parameter of an AdamW step on the model's own parameters times ``Psi_local``, the step as
the program runs it: eager, torch's default implementation. Eager, the step of DTensor parameters
(FSDP2's, ZeRO-2/3) pays the device's ``dtensor_step_overhead`` per parameter tensor, with or without
measured times: DTensor's dispatch of each op of the update (measured on this machine's ranks,
profiler/step_conditions.py; 0 for the presets, whose kernels run behind the host). Compiled
(``Precision.kernels`` not "eager"), the step runs through torch.compile, as compiled programs run
it (runtime/optim.py), whose generated code runs on the local tensors: no such term. Tensor-parallel
shards are stepped as plain tensors (driver/assembly.py), as Megatron's optimizer steps them: none either.

Offloading (``ParallelConfig.offload``, offload.py) steps the optimizer on the host's CPU cores: "all"
(ZeRO-3's shards in host memory) adds each shard's trip over the host link to its gathers and
reduce-scatters; "optimizer" adds the gradients' trip to the host and the updated weights' back to the
step, after it (nothing hides them).

Every function takes floats or numpy arrays alike: the stage DP prices every run of layers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cluster import Cluster
from ..config import ParallelConfig, Precision
from ..runtime.buckets import dp_bucket_bytes
from .comm import Collective, GroupPlacement, collective_lines, collective_time, place_axes
from .compute import MeasuredTimes
from .offload import copy_time, cpu_step_time, optimizer_round_trip

@dataclass
class StepTail:
    """The once-per-step costs of configs on one cluster (module docstring); caches collective lines.

    ``measured``: the profiled ops, whose AdamW step prices the optimizer (measured on first use)."""

    cluster: Cluster
    precision: Precision
    measured: MeasuredTimes | None = None
    _lines: dict = field(default_factory=dict)

    def collective(self, kind: Collective, nbytes, group: GroupPlacement, calls=1):
        """collective_time on floats or arrays, for ``nbytes`` moved in ``calls`` equal collectives:
        ``min(calls * alpha + beta * nbytes)`` over the collective's lines; 0 for 0 bytes."""
        key = (kind, group)
        if key not in self._lines:
            self._lines[key] = collective_lines(kind, group, self.cluster)
        nbytes = np.asarray(nbytes, dtype=float)
        if nbytes.ndim == 0 and np.ndim(calls) == 0:   # one size: the same sums in floats, without arrays
            n = float(nbytes)
            return np.asarray(min(calls * alpha + beta * n for alpha, beta in self._lines[key]) if n > 0 else 0.0)
        best = np.min([calls * alpha + beta * nbytes for alpha, beta in self._lines[key]], axis=0)
        return np.where(nbytes > 0, best, 0.0)

    def dp_time(self, cfg: ParallelConfig, micro_batches: int, groups: dict[str, GroupPlacement],
                params, fwd, bwd, recompute, tp_comm, tp_grad_bytes, units, experts=0.0, kept=0.0, n_kept=0.0,
                fp8: tuple[int, int, int, int] | None = None, lead=0.0):
        """Data-parallel / ZeRO communication of one device that compute does not hide, per step (with
        the tensor-parallel group's own gradient all-reduce, when the layout has one).

        Gradients go in ``dp_bucket_bytes`` buckets (one collective each); ZeRO-2 and 3 gather and
        reduce-scatter unit by unit (one collective per unit held, ``units``: ParamTables.shard_units);
        ZeRO-3 gathers again for backward every unit but the ``n_kept`` units of ``kept`` parameters
        (``ShardUnits.kept``). ``fp8``: the (elements, tensors) of ``params`` FSDP2 gathers in fp8, and of
        ``kept`` (Precision.gathers_fp8, low_precision.py): one byte an element, their scales from one
        all-reduce of their amaxes a step. ``lead``: the parameters of the tensor whose gradient the device's
        backward completes last (ParamTables.lead_params): the last bucket holds at least it, and ZeRO-1's
        gather under the next forward needs it first.
        Dense weights synchronise over ``groups["dp"]`` (dp * cp ranks), the ``experts`` of ``params``
        over ``groups["edp"]``."""
        group, tp_group = groups["dp"], groups["tp"] if cfg.tp > 1 else None
        params = np.asarray(params, dtype=float)
        experts = np.asarray(experts, dtype=float)
        hidden = bwd + recompute
        parts = [(params - experts, group), (experts, groups["edp"])]
        tp_bytes = np.asarray(tp_grad_bytes, dtype=float)
        g_b, w_b = self.precision.grad_bytes, self.precision.weight_bytes
        tp_buckets = _buckets(tp_bytes, cfg.tp, g_b)
        tp_sync = (self.collective(Collective.ALL_REDUCE, tp_bytes, tp_group, tp_buckets)
                   if tp_group is not None else 0.0)
        if cfg.grad_replicas == 1 and cfg.offload != "all":   # offloaded, FSDP2 copies on a one-rank mesh too
            total = tp_sync + 0.0 * params
            return total - self.overlap(tp_group) * np.minimum(hidden, total - total / tp_buckets)
        o = self.overlap(group)
        if cfg.zero >= 2:
            # offloaded (offload.py): each shard crosses the host link before its gather, after its reduction
            def host(n, grp):
                return copy_time(self.cluster.device, self.precision, cfg, n / grp.size)
            # gathered in fp8: f8 of the dense elements at one byte; before the step's first gather the amax of
            # each of the f8_tensors weights' shards, read once, all-reduced in one call (nothing hides either)
            f8, f8_tensors, f8_kept, f8_kept_tensors = fp8 if fp8 is not None else (0, 0, 0, 0)
            device = self.cluster.device
            scales = (self.collective(Collective.ALL_REDUCE, 4.0 * np.asarray(f8_tensors, dtype=float), group)
                      + f8 / group.size * w_b / (device.memory_bandwidth * device.memory_efficiency))
            dense = parts[0][0]
            edp = groups["edp"]
            # FSDP2's copies around each unit's collectives (module docstring): the gather's copy-in of the shards
            # on its own stream, before it; its copy-out into the unsharded parameters and the reduce-scatter's
            # copy-in of the unsharded gradients on the compute stream, nothing beside them
            def gathered(n_dense, n_f8):   # bytes of the unsharded weights a gather of these elements delivers
                return (n_dense - n_f8) * w_b + n_f8

            def copy_in(n_dense, n_f8, calls):
                return self.passes(2 * (gathered(n_dense, n_f8) / group.size + experts * w_b / edp.size), calls)

            def copy_out(n_dense, n_f8, calls):
                return self.passes(2 * (gathered(n_dense, n_f8) + experts * w_b), calls)
            ag = (self.collective(Collective.ALL_GATHER, gathered(dense, f8), group, units)
                  + self.collective(Collective.ALL_GATHER, experts * w_b, edp, units)
                  + host(dense, group) + host(experts, edp) + copy_in(dense, f8, units))
            rs = sum(self.collective(Collective.REDUCE_SCATTER, n * g_b, grp, units) + host(n, grp) for n, grp in parts)
            scatter_in = self.passes((dense + experts) * (w_b + g_b), units)   # unsharded gradients -> the reduce dtype
            fwd_c, bwd_c = fwd + tp_comm / 2, hidden + tp_comm / 2
            # forward prefetch needs a host that runs ahead of its device (GPU streams); a CPU rank
            # computes on the thread that would issue the next gather, so forward hides nothing there
            o_fwd = 0.0 if self.cluster.device.is_cpu else o
            gather = ag - o_fwd * np.minimum(ag, fwd_c)
            # the step's first gather and last reduce-scatter have no compute beside them: an equal unit's, or the
            # unit holding the lead tensor (its first gathered, its gradient the last complete)
            lead = np.minimum(np.asarray(lead, dtype=float), dense)
            per_unit = np.maximum(1, units)
            edges = (o_fwd * np.maximum(ag / per_unit, self.collective(Collective.ALL_GATHER, lead * w_b, group)
                                        + host(lead, group) + self.passes(2 * lead * w_b / group.size))
                     + o * np.maximum(rs / per_unit, self.collective(Collective.REDUCE_SCATTER, lead * g_b, group)
                                      + host(lead, group)))
            if cfg.zero == 3:   # gathered again for backward, every micro-batch, all but the kept units
                kept = np.asarray(kept, dtype=float)
                again_f8 = f8 - f8_kept
                regathered = units - n_kept
                again = (self.collective(Collective.ALL_GATHER, gathered(dense - kept, again_f8), group, regathered)
                         + self.collective(Collective.ALL_GATHER, experts * w_b, edp, units)
                         + host(dense - kept, group) + host(experts, edp) + copy_in(dense - kept, again_f8, regathered))
                copies = copy_out(dense, f8, units) + copy_out(dense - kept, again_f8, regathered) + scatter_in
                return (micro_batches * (gather + again + rs - o * np.minimum(again + rs, bwd_c) + copies) + edges
                        + tp_sync + scales)
            return (gather + copy_out(dense, f8, units) + edges + micro_batches * (rs - o * np.minimum(rs, bwd_c)
                                                                                    + scatter_in)
                    + tp_sync + scales)
        total, buckets, gather = 0.0, 0.0, 0.0
        for n, grp in parts:
            nb = _buckets(n * g_b, grp.size, g_b)
            buckets = buckets + np.where(n > 0, nb, 0.0)
            total = total + self.collective(self._grad_reduce(cfg), n * g_b, grp, nb)
            if cfg.zero == 1:
                gather = gather + self.collective(Collective.ALL_GATHER, n * w_b, grp, nb)
        buckets = np.maximum(1.0, buckets)
        total = total + tp_sync
        # the bucket nothing hides: an equal share, or the one holding the lead tensor (a bucket never splits a
        # tensor), whose gradient is complete only when the backward ends and which the next forward needs first
        lead = np.minimum(np.asarray(lead, dtype=float), params - experts)
        last = np.maximum(total / buckets, self.collective(self._grad_reduce(cfg), lead * g_b, group))
        first = np.maximum(gather / buckets, self.collective(Collective.ALL_GATHER, lead * w_b, group)
                           if cfg.zero == 1 else 0.0)
        # ZeRO-1's gather: hidden under the next step's first forward, bucket by bucket, or after the step, exposed
        return (total - o * np.minimum(hidden, np.maximum(total - last, 0.0))
                + gather - self._gather_overlap(o) * np.minimum(fwd, np.maximum(gather - first, 0.0)))

    def passes(self, nbytes, calls=1):
        """Seconds of memory-bound copies moving ``nbytes`` (read and written counted) in ``calls`` kernels on one
        device while every rank runs them (compute.py's concurrency); 0 for 0 bytes. Floats or arrays."""
        device = self.cluster.device
        nbytes = np.asarray(nbytes, dtype=float)
        t = (nbytes / (device.memory_bandwidth * device.memory_efficiency) + calls * device.kernel_overhead)
        return np.where(nbytes > 0, t * device.concurrency_slowdown, 0.0)

    def dp_floor(self, cfg: ParallelConfig, micro_batches: int, groups: dict[str, GroupPlacement],
                 params: float, experts: float = 0.0) -> float:
        """A lower bound on :meth:`dp_time` of any device holding at least ``params`` parameters
        (``experts`` of the total expert ones, for the mix of groups), whatever its compute: the
        part of each collective compute never hides, ``(1 - o)``, with one call each. Collective
        times are subadditive in bytes (``min`` of ``alpha + beta n`` lines, 0 at 0 bytes), so the
        dense and expert parts together take at least the cheaper group's time for their sum."""
        if cfg.grad_replicas == 1 or params <= 0:
            return 0.0
        spans = [groups["dp"]] + ([groups["edp"]] if experts > 0 else [])

        def least(kind: Collective, nbytes: float) -> float:
            return min(float(self.collective(kind, nbytes, g)) for g in spans)
        o = self.overlap(groups["dp"])
        # gathered in fp8 (Precision.gathers_fp8), any of the parameters may be a weight gathered at one byte
        w_bytes = 1 if self.precision.gathers_fp8(cfg) else self.precision.weight_bytes
        g_b, w_b = self.precision.grad_bytes * params, w_bytes * params
        if cfg.zero >= 2:
            o_fwd = 0.0 if self.cluster.device.is_cpu else o
            ag, rs = least(Collective.ALL_GATHER, w_b), least(Collective.REDUCE_SCATTER, g_b)
            if cfg.zero == 2:
                return (1 - o_fwd) * ag + micro_batches * (1 - o) * rs
            return micro_batches * ((1 - o_fwd) * ag + (1 - o) * (ag + rs))
        if cfg.zero == 0:
            return (1 - o) * least(Collective.ALL_REDUCE, g_b)
        return ((1 - o) * least(self._grad_reduce(cfg), g_b)
                + (1 - self._gather_overlap(o)) * least(Collective.ALL_GATHER, w_b))

    def _grad_reduce(self, cfg: ParallelConfig) -> Collective:
        """The collective reducing ZeRO-0/1's gradients: an all-reduce at ZeRO-0; at ZeRO-1 a reduce-scatter, or the
        all-reduce DeepSpeed 0.4.4-0.12's stage 1 runs (``Precision.grad_reduce``)."""
        if cfg.zero == 0 or self.precision.grad_reduce == "all_reduce":
            return Collective.ALL_REDUCE
        return Collective.REDUCE_SCATTER

    def _gather_overlap(self, o: float) -> float:
        """The share of ZeRO-1's gather of the updated weights that compute hides: ``o`` under the next forward
        (Precision.param_gather "overlapped"; a host that runs ahead of its device, so not on a CPU, as ZeRO-2/3's
        forward prefetch), none after the step ("after_step")."""
        return o if self.precision.param_gather == "overlapped" and not self.cluster.device.is_cpu else 0.0

    def overlap(self, group: GroupPlacement | None) -> float:
        """The fraction of a collective's time compute hides on the links ``group`` uses, net of the
        compute the overlap slows down (``Device.overlap_slowdown``)."""
        kept = 1.0 - self.cluster.device.overlap_slowdown
        if group is None:
            return kept
        return kept * (self.cluster.intra_node if group.nodes == 1 else self.cluster.inter_node).overlap

    def loss_share_time(self, cfg: ParallelConfig, hidden: float = float("inf")) -> float:
        """The step's losses all-reduced over every device once per step (the runtime's ``train_step``
        returns them on every rank), not hidden by the ``hidden`` seconds of backward that follow the last
        loss (the default, unbounded, gives the least it can expose); none when every rank computes every
        loss (tensor parallelism alone), or when the losses go in the gradients' all-reduce (fp32
        gradients reduced over every rank: ``ParallelConfig.losses_ride_gradients``)."""
        if not cfg.shares_losses or (cfg.losses_ride_gradients and self.precision.grads == "fp32"):
            return 0.0
        world = place_axes(self.cluster, [("world", self.cluster.devices)])["world"]
        t = collective_time(Collective.ALL_REDUCE, 4.0, world, self.cluster)
        return t - self.overlap(world) * min(t, hidden)

    def accumulation_pass(self, cfg: ParallelConfig, params, experts=0.0):
        """Seconds of one pass adding a micro-batch's weight gradients into the accumulated ones on one device holding
        ``params`` parameters, ``experts`` of them expert weights (Precision.grad_accumulation "autograd"; 0 when
        "fused"): it reads the accumulated gradients and the new ones and writes their sum, a memory-bound pass over
        the gradients the device keeps: all of its parameters' at ZeRO 0-1 (the new ones in the weights' dtype, the
        sum in ``grads``'), its shard at ZeRO 2-3 (each micro-batch's gradients are reduce-scattered first, as FSDP2
        does); floats or arrays. Linear in the parameters."""
        p = self.precision
        params, experts = np.asarray(params, dtype=float), np.asarray(experts, dtype=float)
        if p.grad_accumulation == "fused":
            out = 0.0 * params
        else:
            if cfg.zero >= 2:
                local, new = np.asarray(cfg.zero_shard(params, experts), dtype=float), p.grad_bytes
            else:
                local, new = params, p.weight_bytes
            device = self.cluster.device
            out = local * (2 * p.grad_bytes + new) / (device.memory_bandwidth * device.memory_efficiency) \
                * device.concurrency_slowdown
        return float(out) if out.ndim == 0 else out

    def accumulation_time(self, cfg: ParallelConfig, params, experts=0.0, micro_batches: int = 1):
        """Seconds a step of ``micro_batches`` spends adding their weight gradients: one :meth:`accumulation_pass`
        per micro-batch after the first."""
        return max(micro_batches - 1, 0) * self.accumulation_pass(cfg, params, experts)

    def optimizer_time(self, cfg: ParallelConfig, params, experts=0.0, param_tensors: int = 0):
        """The optimizer step of one device holding ``params`` parameters, ``experts`` of them expert
        weights, in ``param_tensors`` tensors (0: not counted); floats or arrays. ZeRO divides the dense
        ones by dp * cp, the experts by dp * cp / ep."""
        params, experts = np.asarray(params, dtype=float), np.asarray(experts, dtype=float)
        local = params if cfg.zero == 0 else cfg.zero_shard(params, experts)
        kernels = self.precision.kernels
        measured = self.measured.optimizer_seconds_per_param(kernels) if self.measured is not None else None
        device = self.cluster.device
        if cfg.offload != "none" and not device.is_cpu:   # on the host's CPU cores (offload.py)
            out = np.asarray(cpu_step_time(device, local))
        else:
            if measured is not None:
                out = local * measured
            else:
                p = self.precision
                per_param = 2 * p.optimizer_bytes + p.grad_bytes + p.weight_bytes
                out = local * per_param / (device.memory_bandwidth * device.memory_efficiency)
            if cfg.zero >= 2 and cfg.grad_replicas > 1 and kernels == "eager" and cfg.offload != "optimizer":
                # FSDP2's DTensor parameters: DTensor dispatches every op of each tensor's update (not under
                # offload="optimizer": its host copies are plain tensors)
                out = out + param_tensors * device.dtensor_step_overhead
        if cfg.offload == "optimizer":   # the gradients to the host, the updated weights back: two copies a tensor
            stepped = param_tensors / cfg.grad_replicas if cfg.zero == 1 else param_tensors   # ZeRO-1: whole tensors
            out = out + optimizer_round_trip(device, self.precision, local) + 2 * stepped * device.dispatch_overhead
        out = out * self.cluster.device.concurrency_slowdown   # every rank steps at once (compute.py)
        return float(out) if out.ndim == 0 else out


def _buckets(nbytes, ranks: int, element_bytes: int):
    """Gradient buckets of ``dp_bucket_bytes(ranks, element_bytes)`` (at least one)."""
    return np.maximum(1.0, np.ceil(np.asarray(nbytes, dtype=float) / dp_bucket_bytes(ranks, element_bytes)))
