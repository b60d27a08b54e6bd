"""Plan: a parallel configuration with its stage partition and predicted costs.

Frozen dataclasses with a versioned JSON form (``SCHEMA_VERSION``). Units: seconds,
bytes, FLOPs, samples/s; formatting happens only where people read it (autopar/report, autopar/viz).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from .interval import StepInterval, step_interval
from .loss import LossSource
from .sharding import ShardingGroup
from .structure import ModelStructure
from ..cluster import Cluster
from ..config import ParallelConfig, Precision
from ..errors import ConfigError
from ..files import write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..exports import Export
    from ..report import PlanComparison

SCHEMA_VERSION = 3


@dataclass(frozen=True)
class TimeBreakdown:
    """Where one optimizer step's time goes on the critical path (seconds, summing to the step)."""

    compute: float        # forward + backward of the slowest pipeline device, all micro-batches
    recompute: float      # activation recomputation on that device
    tp_comm: float        # tensor-parallel collectives on that device (not overlapped)
    p2p: float            # pipeline sends/receives on that device
    bubble: float         # pipeline fill and drain
    dp_comm: float        # data-parallel / ZeRO communication not hidden behind compute
    optimizer: float      # the optimizer step
    cp_comm: float = 0.0  # context-parallel ring (keys and values) not hidden behind attention
    ep_comm: float = 0.0  # expert-parallel dispatch and combine all-to-alls

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.p2p + self.bubble + self.dp_comm
                + self.optimizer + self.cp_comm + self.ep_comm)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "total": self.total}


@dataclass(frozen=True)
class Stage:
    """One pipeline device's share: its layers and its costs per micro-batch."""

    index: int
    layers: tuple[str, ...]           # layer names, in order (all chunks when interleaved)
    chunks: tuple[tuple[str, ...], ...]  # per model chunk (one chunk unless interleaved)
    param_count: int                  # parameters held (after tensor parallelism, before ZeRO)
    fwd_time: float                   # compute per micro-batch, seconds
    bwd_time: float
    recompute_time: float
    tp_comm_time: float
    p2p_time: float
    in_flight: int                    # micro-batch passes whose activations are held at the peak
    activation_per_microbatch: float  # bytes
    memory: MemoryBreakdown
    cp_comm_time: float = 0.0         # context-parallel ring not hidden, per micro-batch
    ep_comm_time: float = 0.0         # expert-parallel all-to-alls, per micro-batch
    expert_param_count: int = 0       # of param_count, expert weights (after expert parallelism)
    wgrad_time: float = 0.0           # of bwd_time, the weight gradients: a zero-bubble schedule's W pass

    @property
    def work(self) -> float:
        """Seconds per micro-batch: everything this device does for one micro-batch."""
        return (self.fwd_time + self.bwd_time + self.recompute_time + self.tp_comm_time + self.p2p_time
                + self.cp_comm_time + self.ep_comm_time)


@dataclass(frozen=True)
class Alternative:
    """A configuration the solver evaluated and did not choose, and why."""

    config: ParallelConfig
    step_time: float        # seconds (for one that does not fit: a lower bound)
    peak_memory: float      # bytes (for one that does not fit: the least it could reach)
    fits: bool
    reason: str             # "slower by 3.2%" / "does not fit: needs 4.1 GB more per device ..."
    breakdown: TimeBreakdown | None = None   # its step time's parts (None for one that does not fit)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "step_time": self.step_time, "peak_memory": float(self.peak_memory),
                "fits": self.fits, "reason": self.reason,
                "breakdown": None if self.breakdown is None else asdict(self.breakdown)}


@dataclass(frozen=True)
class Plan:
    """A parallel plan and its predicted cost. Made by :func:`autopar.estimate` / :func:`autopar.plan`."""

    model_name: str
    fingerprint: str                   # the model's structure's fingerprint (capture/structure.py)
    cluster: Cluster
    config: ParallelConfig
    precision: Precision
    global_batch_size: int
    micro_batches: int                 # per pipeline, per step
    step_time: float                   # seconds per optimizer step
    peak_memory: float                 # bytes, the largest over all devices
    throughput: float                  # samples per second
    model_flops: float                 # FLOPs per step without recomputation
    hardware_flops: float              # FLOPs per step actually executed (with recomputation)
    breakdown: TimeBreakdown
    stages: tuple[Stage, ...]
    fits: bool                         # peak_memory <= device memory
    notes: tuple[str, ...] = ()
    optimal: bool | None = None        # set by the solver; None for an estimate
    gap: float | None = None           # when not optimal: (step_time - lower bound) / step_time, if known
    alternatives: tuple[Alternative, ...] = ()   # the solver's runners-up, best first
    sharding: tuple[ShardingGroup, ...] = ()   # per layer group: each op's tensor-parallel placements
    structure: ModelStructure | None = None    # the layers, ops and parameters the plan relies on (None in
                                               # plans of schema 1, which parallelize refuses)
    loss: LossSource | None = None             # how the loss priced was made (capture/loss.py; None in plans
                                               # written before it was recorded)
    schema_version: int = SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def model_chunks(self) -> list[tuple[str, ...]]:
        """The layer names of every model chunk in model order: chunk ``c`` is stage
        ``config.chunk_device(c)``'s chunk at its place in ``config.device_chunks`` (looped: chunk ``c // pp``
        of stage ``c mod pp``, Megatron-LM's and torch.distributed.pipelining's order; ZB-V: a V)."""
        cfg, out = self.config, []
        for c in range(cfg.pp * cfg.virtual_stages):
            d = cfg.chunk_device(c)
            out.append(tuple(self.stages[d].chunks[cfg.device_chunks(d).index(c)]))
        return out

    @property
    def devices(self) -> int:
        return self.config.devices

    @property
    def tflops_per_device(self) -> float:
        """Achieved hardware FLOP/s per device (recomputation included, as Megatron-LM reports), in TFLOP/s."""
        return self.hardware_flops / (self.step_time * self.devices) / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the devices' peak (of the dtype weights are kept
        in: an fp8 plan's over the bf16 peak, as torchtitan counts its float8 runs')."""
        peak = self.cluster.device.peak(self.precision.storage)
        return self.model_flops / (self.step_time * self.devices * peak)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: the FLOPs executed (recomputation included) per second over the peak
        (:attr:`mfu`'s)."""
        peak = self.cluster.device.peak(self.precision.storage)
        return self.hardware_flops / (self.step_time * self.devices * peak)

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample of a sequence model (its sequence length), read from the example inputs the
        plan records (``extra["inputs"]``, see :func:`sequence_tokens`); None for other models and for
        plans that record no inputs."""
        return sequence_tokens(self.extra.get("inputs"))

    @property
    def tokens_per_second(self) -> float | None:
        """Throughput in tokens/s (``throughput * tokens_per_sample``) for sequence models, else None."""
        tokens = self.tokens_per_sample
        return None if tokens is None else self.throughput * tokens

    def step_time_interval(self) -> StepInterval:
        """The 80% interval of the step time a run would measure, from the cost model's recorded errors on
        published validation runs of this device family (plan/interval.py); ``known`` is False, and
        ``basis`` says why, on a device no validation run covers. Derived when read, not stored."""
        return step_interval(self.cluster.device.name, self.step_time)

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-native values (dicts, lists, str, numbers, bool, None), schema_version first."""
        # Not dataclasses.asdict(self): it deep-copies the cluster's read-only peak_flops mapping,
        # which cannot be copied; each part converts itself instead.
        data: dict[str, Any] = {"schema_version": self.schema_version}
        for f in fields(self):
            if f.name != "schema_version":
                data[f.name] = getattr(self, f.name)
        data["cluster"] = self.cluster.to_dict()
        data["config"] = self.config.to_dict()
        data["precision"] = self.precision.to_dict()
        data["breakdown"] = asdict(self.breakdown)
        # Memory is float bytes in the schema (the cost model may hand over ints): a reloaded plan
        # then writes the same bytes.
        data["stages"] = [{**asdict(s), "memory": {k: float(v) for k, v in asdict(s.memory).items()}}
                          for s in self.stages]
        data["alternatives"] = [a.to_dict() for a in self.alternatives]
        data["sharding"] = [g.to_dict() for g in self.sharding]
        data["structure"] = None if self.structure is None else self.structure.to_dict()
        data["loss"] = None if self.loss is None else self.loss.to_dict()
        data["extra"] = dict(self.extra)
        return _json_native(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON atomically (temporary file, then rename), with open()'s permissions."""
        write_atomic(path, self.to_json())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan of a dict :meth:`to_dict` made (a one-line facade on plan/io.py, the strict reader)."""
        from .io import plan_from_dict
        return plan_from_dict(data)

    # --- reading it (autopar/report, autopar/viz) -------------------------------------------------
    def summary(self) -> str:
        """A text table: configuration, step-time breakdown, memory per stage against the device, MFU."""
        from ..report import summarize
        return summarize(self)

    def explain(self) -> str:
        """Why this plan: where the time and memory go, each parallel choice, and why each runner-up lost."""
        from ..report import explain
        return explain(self)

    def compare(self, other: "Plan") -> "PlanComparison":
        """This plan (A) beside ``other`` (B); ``print()`` it, or show it in a notebook."""
        from ..report import compare
        if not isinstance(other, Plan):
            raise ConfigError(f"compare() takes another autopar.Plan, got {type(other).__name__}")
        return compare(self, other)

    def plot_timeline(self, path: str | os.PathLike | None = None, **kwargs: Any) -> "Figure":
        """The pipeline schedule as a Gantt chart (one row per stage); a PNG at ``path`` if given."""
        from ..viz import plot_timeline
        return plot_timeline(self, path, **kwargs)

    def plot_memory(self, path: str | os.PathLike | None = None) -> "Figure":
        """Memory per stage, stacked by kind, against the device's memory; a PNG at ``path`` if given."""
        from ..viz import plot_memory
        return plot_memory(self, path)

    def plot_partition(self, path: str | os.PathLike | None = None) -> "Figure":
        """Which layers each pipeline stage holds; a PNG at ``path`` if given."""
        from ..viz import plot_partition
        return plot_partition(self, path)

    def export(self, stack: str, path: str | os.PathLike | None = None) -> "Export":
        """The plan in a training stack's configuration ("torchtitan", "megatron", "deepspeed",
        "accelerate"): its text, each field traced to this plan, and what the stack cannot express
        (autopar/exports); written to ``path`` too when given."""
        from ..exports import export
        return export(self, stack, path)

    def _repr_html_(self) -> str:
        from ..report import plan_html
        return plan_html(self)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        """One line: the model, the cluster, the configuration, the step time (s) and whether it fits
        (``str(plan)`` / ``summary()`` is the full table, ``to_dict()`` every field)."""
        c = self.cluster
        return (f"Plan(model_name={self.model_name!r}, cluster='{c.nodes}x{c.devices_per_node}x{c.device.name}', "
                f"config={self.config.short()!r}, step_time={self.step_time:.6g}, fits={self.fits})")


def _json_native(value: Any) -> Any:
    """Tuples become lists and mappings dicts, recursively, so that to_dict() == json.loads(to_json())."""
    if isinstance(value, Mapping):
        return {k: _json_native(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_native(v) for v in value]
    return value


TOKEN_DTYPES = frozenset({"int64", "int32", "int16", "uint16", "uint32", "uint64"})
"""Dtypes of token-id inputs (a bool or uint8 tensor is a mask; a float one, features or embeddings)."""


def sequence_tokens(inputs: Mapping[str, Any] | None) -> int | None:
    """Tokens per sample of the inputs a plan records (``extra["inputs"]``, codegen/inputs.py), or None.

    Token ids are an integer tensor of shape ``[batch, sequence]``: the keyword input ``input_ids`` when
    there is one (for an encoder-decoder model, the encoder's sequence, as T5 counts its tokens),
    else the first such input. A model without one (images, features, embeddings given as floats)
    has no tokens, and its throughput stays in samples/s.
    """
    if not isinstance(inputs, Mapping):
        return None
    if inputs.get("kind") == "kwargs" and isinstance(inputs.get("kwargs"), Mapping):
        named = dict(inputs["kwargs"])
        leaves = [named.pop("input_ids")] if "input_ids" in named else []
        leaves += list(named.values())
    else:
        leaves = list(inputs.get("args") or ())

    for leaf in leaves:
        if isinstance(leaf, Mapping) and leaf.get("dtype") in TOKEN_DTYPES:
            shape = leaf.get("shape")
            if isinstance(shape, (list, tuple)) and len(shape) == 2 and isinstance(shape[1], int) and shape[1] > 0:
                return shape[1]
    return None
