"""The search space: every configuration of the devices the outer search may consider.

A point is a :class:`Candidate`: a tensor-parallel layout variant, the mesh degrees
``dp x cp x tp x pp`` and the expert-parallel degree ``ep`` dividing ``dp`` (placed on the
topology by :func:`autopar.cost_model.mesh.mesh_groups`:
``tp`` innermost, so it lands inside a node when it fits, but any degree that divides the
devices is tried, including ones that span nodes), micro-batch size, schedule (1F1B, GPipe,
interleaved 1F1B with each virtual-stage count that leaves a block per chunk; chunks the blocks do not
divide evenly are balanced by cost), ZeRO stage and
sequence parallelism. Context parallelism is tried at every degree the model's fused attention
and sequence length allow (cost_model/context_parallel.py), with every tensor-parallel degree beside it
(NVIDIA's Llama 3.1 recipes run tp=8 x cp=2), expert parallelism at every degree
dividing both dp and the expert count of its mixture-of-experts layers. Recompute is chosen per stage by the stage DP (stages.py), so it is
not a dimension here except for the interleaved schedule.

:func:`branches` walks the space by :class:`Branch`: one mesh, expert degree and micro-batch size, with
the schedules, ZeRO stages and sequence-parallel choices its candidates take (the search bounds them
together, :func:`candidates` lists them one by one).

``fixed`` pins any ParallelConfig field. The caps below (MAX_TP, MAX_CP, MAX_VIRTUAL_STAGES, ZeRO
only with data-parallel replicas) bound what the search explores on its own and never a pinned value; what the model and cluster rule out (a degree that
does not divide the devices or place uniformly on the nodes, more stages than layers, more chunks
than blocks...) is refused, naming the rule and the nearest values that work
(:func:`pin_conflicts`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping, NamedTuple

from ..capture.opgraph import OpGraph
from ..cluster import Cluster
from ..config import OFFLOADS, RECOMPUTE_MODES, SPLIT_BACKWARD, ParallelConfig
from ..cost_model import context_parallel, expert_parallel
from ..cost_model.mesh import mesh_groups
from ..errors import ConfigError
from ..runtime.schedules import runs_micro_batches

MAX_TP = 64               # beyond 64-way tensor parallelism every layer of a real model is communication bound
MAX_CP = 32               # the ring's per-step block (S / cp tokens) stops hiding its transfer long before
MAX_VIRTUAL_STAGES = 8    # Megatron-LM's interleaving rarely pays beyond a few chunks per device
_FIXABLE = tuple(f.name for f in fields(ParallelConfig))


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search (a ParallelConfig without its recompute, plus the layout variant)."""

    variant: str
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    zero: int
    sequence_parallel: bool
    cp: int = 1
    ep: int = 1
    offload: str = "none"

    def config(self, recompute: str = "none", stage_recompute: tuple[str, ...] = (),
               recompute_layers: int = 0) -> ParallelConfig:
        return ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                              micro_batch_size=self.micro_batch_size, schedule=self.schedule,
                              virtual_stages=self.virtual_stages, zero=self.zero, offload=self.offload,
                              recompute=recompute,
                              sequence_parallel=self.sequence_parallel, stage_recompute=stage_recompute,
                              recompute_layers=recompute_layers)

    def with_modes(self, modes: tuple[str, ...]) -> ParallelConfig:
        """The config with one recompute mode per stage (a single ``recompute`` when they agree)."""
        if len(set(modes)) <= 1:
            return self.config(modes[0] if modes else "none")
        return self.config(modes[0], tuple(modes))

    def micro_batches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    def sort_key(self) -> "Key":
        return Key(self.variant, self.dp, self.tp, self.pp, self.cp, self.ep, self.micro_batch_size, self.schedule,
                   self.virtual_stages, self.zero, self.sequence_parallel, OFFLOADS.index(self.offload))

    @classmethod
    def of(cls, key: "Key") -> "Candidate":
        """The candidate of a :meth:`sort_key`."""
        return cls(key.variant, key.dp, key.tp, key.pp, key.micro_batch_size, key.schedule, key.virtual_stages,
                   key.zero, key.sequence_parallel, key.cp, key.ep, OFFLOADS[key.offload])


class Key(NamedTuple):
    """A candidate's fields in the order that breaks ties between equal bounds (the search queues keys,
    and makes the candidate of the few it reaches)."""

    variant: str
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    zero: int
    sequence_parallel: bool
    offload: int = 0   # OFFLOADS' index: none, optimizer, all


def check_fixed(fixed: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate ``fixed`` field names and values (each value as ParallelConfig would)."""
    if fixed is None:
        return {}
    if not isinstance(fixed, Mapping):
        raise ConfigError(f"fixed must be a dict of ParallelConfig fields, e.g. {{'tp': 8}}; got {fixed!r}")
    unknown = sorted(set(fixed) - set(_FIXABLE))
    if unknown:
        raise ConfigError(f"fixed has unknown field(s) {unknown}; it can pin: {', '.join(_FIXABLE)}")
    probe = dict(fixed)
    if "stage_recompute" in probe:
        probe["stage_recompute"] = tuple(probe["stage_recompute"])
        if probe["stage_recompute"] and "pp" not in probe:
            probe["pp"] = len(probe["stage_recompute"])
    if probe.get("schedule") == "interleaved" and "pp" not in probe:
        probe["pp"] = 2
    if probe.get("sequence_parallel") and "tp" not in probe:
        probe["tp"] = 2
    if "ep" in probe and "dp" not in probe:
        probe["dp"] = probe["ep"]
    if probe.get("offload") == "all" and "zero" not in probe:
        probe["zero"] = 3
    if probe.get("recompute_layers") and "recompute" not in probe:
        probe["recompute"] = "full"
    ParallelConfig(**probe)  # raises ConfigError naming a bad value
    out = dict(fixed)
    if "stage_recompute" in out:
        out["stage_recompute"] = tuple(out["stage_recompute"])
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recompute_modes(graph: OpGraph, fixed: Mapping[str, Any]) -> tuple[str, ...]:
    """Modes worth trying: the pinned ones when ``stage_recompute`` or ``recompute`` is pinned; else
    "none", "full" and one mode between them: "selective" when the graph has an unfused attention
    core (its s x s scores are what it drops), "op" when it has not (a fused attention's core keeps
    only its output and log-sum-exp, and per-op recomputation is what such programs run between none
    and full, torchtitan's default)."""
    if fixed.get("stage_recompute"):
        return tuple(dict.fromkeys(fixed["stage_recompute"]))
    if fixed.get("recompute_layers"):
        return ("full",)
    if "recompute" in fixed:
        return (fixed["recompute"],)
    has_core = bool(graph.unfused_attention)
    return tuple(m for m in RECOMPUTE_MODES if m != ("op" if has_core else "selective"))


@dataclass(frozen=True)
class Branch:
    """The candidates of one mesh, expert-parallel degree and micro-batch size: every schedule x ZeRO
    stage x sequence parallelism x layout variant (the space's innermost choices, which share their
    per-layer costs: the search bounds them together)."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    micro_batch_size: int
    schedules: tuple[tuple[str, int], ...]   # (schedule, virtual stages)
    zeros: tuple[int, ...]
    sequence_parallel: tuple[bool, ...]
    offload: str = "none"   # every candidate's

    @functools.cached_property
    def leaves(self) -> int:
        """Candidates per sequence-parallel choice and variant."""
        return sum(compatible(s, z) for s, _ in self.schedules for z in self.zeros)

    def candidate(self, variant: str, sp: bool, schedule: str, virtual_stages: int, zero: int) -> Candidate:
        return Candidate(variant, self.dp, self.tp, self.pp, self.micro_batch_size, schedule, virtual_stages, zero,
                         sp, self.cp, self.ep, self.offload)


def branches(graph: OpGraph, cluster: Cluster, global_batch_size: int, fixed: Mapping[str, Any],
             capped: bool = True) -> Iterator[Branch]:
    """The space by :class:`Branch`: every candidate allowed by the devices, the batch, the model's
    layer count and ``fixed``; with ``capped`` False the search's caps on free fields are lifted too
    (every value a user may pin). Branches without candidates are left out."""
    n_dev = cluster.devices
    n_layers = len(graph.layers)
    blocks = sum(1 for layer in graph.layers if layer.is_block)

    def allowed(name: str, values):
        return tuple(v for v in values if name not in fixed or fixed[name] == v)

    # offloading is searched where the device describes a host to offload to (a CPU is its own: nothing to
    # gain), pinned either way by fixed["offload"]
    offloads = ((fixed["offload"],) if "offload" in fixed
                else OFFLOADS if cluster.device.host is not None and not cluster.device.is_cpu else ("none",))
    for tp, cp, pp, dp in _meshes(graph, n_dev, n_layers, fixed, capped):
        if global_batch_size % dp:
            continue
        sps = allowed("sequence_parallel", [False, True] if tp > 1 else [False])
        for offload in offloads:
            # offloading all is ZeRO-3's, on one replica too; the optimizer is offloaded with its states sharded
            # over the replicas where there are some (as DeepSpeed and Megatron-LM offload it: ZeRO >= 1)
            if offload == "all":
                stages = [3]
            elif dp * cp > 1 or "zero" in fixed:
                stages = [1, 2, 3] if offload == "optimizer" and dp * cp > 1 and "zero" not in fixed else [0, 1, 2, 3]
            else:
                stages = [0]
            zeros = allowed("zero", stages)
            if not zeros or not sps:
                continue
            for ep in allowed("ep", [e for e in divisors(dp) if expert_parallel.unsupported(graph, e) is None]):
                for mb in allowed("micro_batch_size", divisors(global_batch_size // dp)):
                    m = global_batch_size // (dp * mb)
                    # Megatron's interleaved order needs m to be a multiple of pp; the zero-bubble schedules are
                    # searched where their steady state is reached (ZB-H1 m >= pp: its stage DP is exact there;
                    # ZB-V and DualPipeV m >= 2 pp: their bubbles no longer depend on m there, cost_model/schedule.py),
                    # DualPipeV nowhere else (torch's refuses fewer)
                    schedules = tuple((s, v) for s, v in _schedules(pp, blocks, fixed, capped)
                                      if runs_micro_batches(s, pp, m)
                                      and (m >= pp * ZB_MICRO_BATCHES.get(s, 0) or "schedule" in fixed))
                    if schedules:
                        yield Branch(tp, cp, pp, dp, ep, mb, schedules, zeros, sps, offload)


def candidates(graph: OpGraph, cluster: Cluster, global_batch_size: int, variants: tuple[str, ...],
               fixed: Mapping[str, Any], capped: bool = True) -> Iterator[Candidate]:
    """Every candidate of :func:`branches`, each with every layout variant of ``variants``."""
    for b in branches(graph, cluster, global_batch_size, fixed, capped):
        for schedule, v in b.schedules:
            for zero in b.zeros:
                if not compatible(schedule, zero):
                    continue
                for sp in b.sequence_parallel:
                    for variant in variants:
                        yield b.candidate(variant, sp, schedule, v, zero)


ZB_MICRO_BATCHES = {"zbh1": 1, "zbv": 2}
"""ZB-H1 and ZB-V are searched with at least this many micro-batches per pipeline device; pinned, with any
(priced then by simulation, and ZB-H1's stage DP minimising its steady-state form). DualPipeV's least
(runtime/schedules.least_micro_batches) holds pinned too: torch refuses fewer."""


def compatible(schedule: str, zero: int) -> bool:
    """Whether a schedule and ZeRO stage go together: the zero-bubble schedules' split backward takes
    ZeRO 0 or 1 only (ParallelConfig's rule)."""
    return schedule not in SPLIT_BACKWARD or zero <= 1


def _meshes(graph: OpGraph, n_dev: int, n_layers: int, fixed: Mapping[str, Any],
            capped: bool) -> Iterator[tuple[int, ...]]:
    """(tp, cp, pp, dp) with ``tp * cp * pp * dp = n_dev`` that ``fixed`` and the model allow."""
    def ok(name: str, value: int) -> bool:
        return name not in fixed or fixed[name] == value

    stages = len(fixed.get("stage_recompute") or ()) or None
    for tp in (d for d in divisors(n_dev) if (d <= MAX_TP or "tp" in fixed or not capped) and ok("tp", d)):
        for cp in (d for d in divisors(n_dev // tp) if (d <= MAX_CP or "cp" in fixed or not capped) and ok("cp", d)):
            if context_parallel.unsupported(graph, cp) is not None:
                continue
            for pp in (d for d in divisors(n_dev // (tp * cp))
                       if d <= n_layers and ok("pp", d) and stages in (None, d)):
                dp = n_dev // (tp * cp * pp)
                if ok("dp", dp):
                    yield tp, cp, pp, dp


def data_parallel_degrees(graph: OpGraph, cluster: Cluster, fixed: Mapping[str, Any]) -> set[int]:
    """The data-parallel degrees the devices, the model and ``fixed`` allow whatever the global batch (the
    search's meshes, placed uniformly on the nodes): what the batch's divisors then cut down (batch.py)."""
    return {dp for tp, cp, pp, dp in _meshes(graph, cluster.devices, len(graph.layers), fixed, True)
            if placeable(cluster, ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp))}


def placeable(cluster: Cluster, cfg: ParallelConfig) -> bool:
    """Whether every mesh axis lands uniformly on the nodes (same ranks per node in every group),
    which the collective cost model assumes; e.g. tp=3 on 8-GPU nodes does not."""
    try:
        groups = mesh_groups(cluster, cfg)
    except ConfigError:
        return False
    dpn = cluster.devices_per_node
    return all(g.ranks_per_node * g.groups_per_node <= dpn and g.nodes <= cluster.nodes for g in groups.values())


def _schedules(pp: int, blocks: int, fixed: Mapping[str, Any], capped: bool) -> list[tuple[str, int]]:
    if pp == 1:
        out = [("1f1b", 1)]
    else:
        out = [("1f1b", 1), ("gpipe", 1)]
        most = max(MAX_VIRTUAL_STAGES, fixed.get("virtual_stages", 1)) if capped else blocks  # a pin is not capped
        # chunks need not divide the blocks: uneven chunks are balanced by cost (Llama 3 405B ran 126
        # layers over 16 stages interleaved), which Megatron-LM's own check does not allow
        out += [("interleaved", v) for v in range(2, most + 1) if pp * v <= blocks]
        # the zero-bubble schedules torch.distributed.pipelining runs: ZB-H1, and ZB-V's and DualPipeV's two chunks
        # a device
        out += [("zbh1", 1)] + ([("zbv", 2), ("dualpipev", 2)] if 2 * pp <= blocks else [])
    return [(s, v) for s, v in out if fixed.get("schedule", s) == s and fixed.get("virtual_stages", v) == v]


# The rule behind each pinnable field, for the message when a pin matches no configuration.
PIN_RULES = {
    "dp": "dp * cp * tp * pp is the device count, dp divides the global batch",
    "tp": "dp * cp * tp * pp is the device count and every mesh axis lands evenly on the nodes",
    "pp": "dp * cp * tp * pp is the device count, pp is at most the model's layers",
    "cp": "dp * cp * tp * pp is the device count and the model's fused attention and sequence split cp ways",
    "ep": "ep divides dp and the experts of every mixture-of-experts layer",
    "micro_batch_size": "dp x micro_batch_size divides the global batch (interleaved: the micro-batches per "
                        "pipeline are a multiple of pp)",
    "virtual_stages": "pp x virtual_stages is at most the repeated blocks (one per chunk)",
    "schedule": "interleaved, zbv and dualpipev need pp > 1 and at least one repeated block per chunk (pp x "
                "virtual_stages), dualpipev 2 x pp micro-batches; zbh1, zbv and dualpipev need zero <= 1, recompute "
                "other than 'op' and kernels other than 'compiled'",
    "zero": "any stage 0-3",
    "sequence_parallel": "sequence parallelism needs tp > 1",
}


def nearest(values: set, pinned: Any) -> str:
    """The valid values nearest a pinned one: the closest below and above (numbers), or all of them."""
    if not values:
        return "none with the other pins"
    if isinstance(pinned, bool) or not isinstance(pinned, (int, float)):
        return ", ".join(map(str, sorted(values, key=str)))
    below = [v for v in values if v < pinned]
    above = [v for v in values if v > pinned]
    picks = ([max(below)] if below else []) + ([min(above)] if above else [])
    return " or ".join(str(v) for v in picks)
