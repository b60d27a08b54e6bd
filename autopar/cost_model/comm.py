r"""Alpha-beta cost of collectives on a two-level (NVLink inside a node, NICs between nodes) topology, and
a third where the fabric has pods.

Notation: a group of ``n`` ranks, ``r`` of them on each of ``N = n / r`` nodes, ``g``
groups of the same axis communicating at once through one node's NICs; ``S`` the
per-rank buffer in bytes (all-reduce: the buffer; all-gather: the OUTPUT; reduce-scatter:
the INPUT; all-to-all: the send buffer; broadcast: the buffer; p2p: the message).
Every bandwidth below is achievable: ``link.bandwidth * link.efficiency`` (bytes/s), or, where
the profiler measured the collective on that link, its fitted ``B`` and ``a`` (``Link.collectives``).

**Single node (N = 1): a ring over the intra-node link** (latency a, bandwidth B).
The nccl-tests bus-bandwidth factors (bench/sources.md section 5) give

* all-reduce        ``t = 2(n-1)/n * S / B + 2(n-1) a``
* all-gather, reduce-scatter ``t = (n-1)/n * S / B + (n-1) a``
* broadcast (pipelined chain) ``t = S / B + (n-1) a``
* all-to-all (pairwise exchange) ``t = (n-1)/n * S / B + (n-1) a``

**Several nodes.** The hierarchical decomposition of an all-reduce is: reduce-scatter
inside the node among ``r`` ranks, all-reduce between the ``N`` nodes on each rank's
``S / r`` shard, all-gather inside the node. It says which bytes cross which link: per
rank ``2(r-1)/r * S`` over NVLink, and per node ``2(N-1)/N * S`` over the NICs.
NCCL does not run those phases one after the other: its ring spans the nodes, cuts the
buffer into chunks that flow through NVLink and the NICs at the same time, and spreads
its channels over all the node's NICs. So the phases overlap and the bandwidth term is
the ring's bus traffic over the *slowest hop*:

    B_eff = min(B_intra, r * b)      (r > 1)        B_eff = b      (r = 1)
    b     = min(inter.bandwidth * devices_per_node / (r * g), intra.bandwidth) * inter.efficiency

``b`` is one rank's share of its node's NICs: the node's ``devices_per_node`` NICs are
shared by the ``r * g`` ranks of this axis' groups that sit on it (NIC sharing), capped at
what a rank can feed through its own links; ``r * b`` is the NIC bandwidth one group's
ring gets when it crosses a node boundary. Summing the phases instead would predict a
DGX A100 multi-node all-reduce busbw of 111-146 GB/s; NCCL measures about 192 GB/s
= 8 NICs x 24 GB/s (bench/sources.md section 5), which is ``r * b`` above. With one rank
per node (``r = 1``) this is a plain ring over the inter-node link.

A ring pass of ``n - 1`` steps has ``n - N`` hops inside nodes and ``N - 1`` across them,
so the latency of one pass is ``L = (n - N) a_intra + (N - 1) a_inter``, linear in the ranks:
at 2,240 A100 (280 nodes) 1,960 NVLink steps and 279 network ones per all-gather:

* all-reduce        ``t = 2(n-1)/n * S / B_eff + 2 L``
* all-gather, reduce-scatter ``t = (n-1)/n * S / B_eff + L``
* broadcast         ``t = S / B_eff + L``
* all-to-all (pairwise exchange, ``n - 1`` steps of ``S / n``): ``r - 1`` steps inside
  the node, ``n - r`` across, so ``(n-1)/n`` of the data moves and the inter-node share
  ``(n-r)/n = (N-1)/N`` goes over the NICs:
  ``t = (r-1)/n * S / B_intra + (n-r)/n * S / b + (r-1) a_intra + (n-r) a_inter``

Since ``B_eff <= B_intra`` and the presets have ``a_inter >= a_intra``, a group spread over
nodes never costs less than the same group inside one (hypothetically large) node.

**Protocols and algorithms, as NCCL chooses them.** A link of a GPU preset lists its collective
library's ring protocols (``Link.protocols``; NCCL's LL, LL128 and Simple): protocol ``p`` adds a
call latency ``c_p``, has per-step latencies ``a_p`` (per link level) and reaches a share ``f_p`` of the
bandwidth. Every formula above is priced per protocol, with ``a`` the protocol's step latency, ``B``
scaled by ``f_p`` and ``c_p`` added, and a call takes the fastest (NCCL's tuner does the same from its
own table): LL wins for small messages, Simple for large ones. So the ring's latency grows with
the number of ranks, ``2(n-1)`` steps per all-reduce.

**A ring across nodes at scale** (NCCL's tuning model, src/graph/tuning.cc, which NCCL's tuner prices
with; constants in presets.py). Two terms make a ring that spans nodes slower than its links alone:

* every step waits for the host's network proxy, which posts each step to the NIC ("inter-node rings
  still have to launch nsteps * net overhead"): an NVLink hop of such a ring takes at least the inter
  link protocol's ``net_step_floor`` (1-2 us, three times that with Simple), so
  ``L = (n - N) max(a_intra, f) + (N - 1) a_inter``. With 8 ranks per node, 7 of every 8 steps are NVLink
  hops: at thousands of ranks this floor, not the NVLink latency, sets the ring's latency;
* LL, whose 8-byte flag+data stores need one network message per few kB, is capped at
  ``bus_bandwidth_cap`` of bus bandwidth across more than two nodes (about 20 GB/s: the proxy's and
  NIC's message rate, not the wire), so at many nodes LL no longer carries a large message cheaply.

Together they price the small-message regime of a sharded-data-parallel collective at thousands of
ranks: a unit of ``S`` bytes moves ``S / n`` per rank per step (tens of kB at 2,240 ranks), each step pays
its latency, and the protocol that wins at that size (LL) is the one whose bandwidth collapses across
nodes. NCCL's PAT algorithm (NCCL >= 2.23: all-gather and reduce-scatter in ``log2 n`` steps) runs only
with one rank per node; a ZeRO-3 group without model parallelism holds 8 per node, so it rings, and PAT
is not priced. NCCL also lowers the channel count for small calls (src/enqueue.cc: fewer than 64 bytes
per thread of 512 for Simple), which at a unit's size (megabytes at least) does not bind: not priced.

Two more ways for an all-reduce:

* across nodes, NCCL's double binary tree: ``t = c_p + 2((r-1) a_intra + ceil(log2 N) a_inter) + 2 S / B_eff``
  (each byte goes up and down the tree once), which beats the ring's ``2(n-1)`` steps of latency
  at thousands of ranks;
* inside one node with in-switch reduction (``Link.sharp_bandwidth``: NVLink SHARP, NCCL's NVLS on
  H100 nodes): ``t = c_sharp + 2(n-1)/n * S / B_sharp``.

A collective with a measured fit (``Link.collectives``, the profiler's gloo links) or a link
without protocols is the plain ring above with ``latency`` per step.

**A fabric of more than one tier** (``Cluster.fabric``: pods of ``pod_nodes`` consecutive nodes under full
bisection bandwidth, joined by a tier that carries ``1 / sigma`` of the pods' NIC bandwidth, as clusters of
tens of thousands of GPUs are built). A group spanning ``P > 1`` pods (``GroupPlacement.pods``) has
``N / P`` of its nodes in each. Its ring, ordered by node, leaves each pod by one edge, which takes the
group's share of the tier above: its nodes own ``(N / P) r b`` of the pod's NICs, of which ``1 / sigma``
goes up, so

    B_eff' = min(B_eff, (N / P) r b / sigma)

(the tree all-reduce alike): a data-parallel ring over hundreds of nodes a pod keeps its bandwidth, a
group with a few nodes in each pod is cut. All-to-all: of a rank's ``n - 1`` peers, ``n / P - r`` share
its pod off its node and ``n - n / P`` sit in other pods, whose share crosses at ``b / sigma``:
``beta = (r-1)/n / B_intra + (n/P - r)/n / b + (n - n/P)/n / (b / sigma)``. The tier adds no latency
of its own: the inter-node link's step latency (NCCL's tuning model) is that of a path through the
network. Point to point is priced as below (one flow per pipeline boundary).

**Point to point**: ``t = S / B + a`` over the intra-node link, or over the inter-node
link (one device's NIC) when the two ranks sit on different nodes.

**A node without a switch** (``Link.peers = k``: AMD's Infinity Fabric joins the 8 GPUs of a node by
7 direct links, no NVSwitch). ``B_intra`` is the sum of a device's ``k`` links; RCCL runs one ring per
link, so a group of ``r`` ranks inside the node moves its data over the ``r - 1`` links to its own
members: every formula above uses ``B_intra (r - 1) / k`` (tp=2 gets one link, tp=8 all seven), and a
point-to-point message one link, ``B_intra / k``. A switched node (``k = 0``) gives every group the full
``B_intra``.

**In context.** A collective issued between compute, as in a training step, can cost more
than back-to-back calls: the backend's threads have gone to sleep and the ranks arrive apart.
Every call adds the link's measured ``context_latency`` (``context_latency_p2p`` for p2p) once;
it is 0 for the presets (NCCL's kernels are queued ahead on the GPU) and measured by the
profiler (gloo on a small VM: several ms).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..cluster import Cluster
from ..hardware import Link, Protocol
from ..errors import ConfigError


class Collective(str, enum.Enum):
    """The collectives the cost model prices."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P = "p2p"

    @classmethod
    def of(cls, kind: "Collective | str") -> "Collective":
        """``kind`` as a Collective, by a dict of the values (``Collective(value)``, an Enum lookup by value,
        was 0.5 s of building HF Llama 405B's sharding ILPs); an unknown value raises as ``Collective(value)``."""
        if isinstance(kind, Collective):
            return kind
        return (_BY_VALUE.get(kind) if isinstance(kind, str) else None) or cls(kind)


_BY_VALUE = {c.value: c for c in Collective}
SELF_TRANSPOSED = frozenset((Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL))
"""The collectives whose backward is the same collective's transpose, of the same volume (a gather's is a
reduce-scatter): a forward one costs its time again in backward. A str enum: the values' strings match too."""


@dataclass(frozen=True, kw_only=True)
class GroupPlacement:
    """Where one process group of a mesh axis lands on the cluster."""

    size: int
    """Ranks in the group."""
    ranks_per_node: int
    """How many of the group's ranks share one node (1 .. devices_per_node); divides ``size``."""
    groups_per_node: int
    """How many groups of this axis communicate at the same time through one node's NICs."""
    pods: int = 1
    """Pods of the cluster's fabric (Cluster.fabric) the group spans; 1 without one."""

    def __post_init__(self) -> None:
        for name in ("size", "ranks_per_node", "groups_per_node", "pods"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GroupPlacement.{name}={value!r} is out of range: it must be an integer >= 1")
        if self.ranks_per_node > self.size or self.size % self.ranks_per_node:
            raise ConfigError(f"GroupPlacement.ranks_per_node={self.ranks_per_node} must divide "
                              f"size={self.size} (a divisor of the group size)")

    @property
    def nodes(self) -> int:
        """Nodes the group spans (``size // ranks_per_node``)."""
        return self.size // self.ranks_per_node


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(k for k in range(1, min(n, limit) + 1) if n % k == 0)


def _placement_by_formula(stride: int, degree: int, per_node: int) -> GroupPlacement | None:
    """Placement of a group ``{base + k * stride}`` for the regular layouts, else None.

    Regular: the group's consecutive members either all sit on distinct nodes
    (``stride >= per_node``), or the node size is a multiple of the stride and the
    group's span ``stride * degree`` divides or is a multiple of the node size (then
    every node the group touches holds ``min(degree, per_node // stride)`` members and
    each of the node's ``per_node`` devices is in exactly one group: ``g = per_node / r``).
    """
    if degree == 1 or stride >= per_node:
        return GroupPlacement(size=degree, ranks_per_node=1, groups_per_node=per_node)
    span = stride * degree
    if per_node % stride == 0 and (per_node % span == 0 or span % per_node == 0):
        r = min(degree, per_node // stride)
        return GroupPlacement(size=degree, ranks_per_node=r, groups_per_node=per_node // r)
    return None


def _placement_by_enumeration(stride: int, degree: int, per_node: int, devices: int) -> GroupPlacement:
    """Placement found by listing every rank's (group, node); any layout.

    When some node holds fewer of a group's ranks than another (e.g. groups of 3 on
    nodes of 8), the placement is made conservative: ``ranks_per_node`` is the largest
    divisor of the size not above the smallest per-node count (fewer ranks per node
    means more inter-node traffic), ``groups_per_node`` the most groups on any node. The group may
    then span more nodes than the cluster has (3 ranks as 2 + 1 on two nodes: 3 nodes of 1).
    """
    ranks = np.arange(devices, dtype=np.int64)
    group = ranks - ((ranks // stride) % degree) * stride
    node = ranks // per_node
    pairs, counts = np.unique(group * (devices // per_node) + node, return_counts=True)
    groups_on_node = np.bincount(pairs % (devices // per_node))
    r = _largest_divisor_at_most(degree, int(counts.min()))
    return GroupPlacement(size=degree, ranks_per_node=r, groups_per_node=int(groups_on_node.max()))


def place_axes(cluster: Cluster, degrees: Sequence[tuple[str, int]]) -> dict[str, GroupPlacement]:
    """Placement of every mesh axis' groups, axes given innermost first.

    ``degrees`` e.g. ``[("tp", 8), ("dp", 32), ("pp", 4)]``: ranks are laid out with the
    first axis varying fastest, ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``, and
    ranks ``k * devices_per_node .. (k+1) * devices_per_node - 1`` form node ``k``.
    The product of the degrees must equal ``cluster.devices``.
    """
    names = [name for name, _ in degrees]
    if len(set(names)) != len(names):
        raise ConfigError(f"mesh axes {names} repeat a name: give each axis once")
    for name, degree in degrees:
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ConfigError(f"mesh axis {name!r} has degree {degree!r}: it must be an integer >= 1")
    product = math.prod(d for _, d in degrees)
    if product != cluster.devices:
        raise ConfigError(f"mesh degrees {dict(degrees)} multiply to {product} but the cluster has "
                          f"{cluster.devices} devices: choose degrees whose product is {cluster.devices}")
    out: dict[str, GroupPlacement] = {}
    stride = 1
    for name, degree in degrees:
        out[name] = place_run(cluster, degree, stride)
        stride *= degree
    return out


def place_run(cluster: Cluster, size: int, stride: int) -> GroupPlacement:
    """Placement of the groups ``{base + k * stride : k < size}`` that tile the cluster's ranks (a
    mesh axis ``stride`` ranks apart), ranks ``k * devices_per_node ..`` forming node ``k`` (and, with a
    fabric, nodes ``j * pod_nodes ..`` pod ``j``)."""
    placement = _placement_by_formula(stride, size, cluster.devices_per_node)
    if placement is None:
        placement = _placement_by_enumeration(stride, size, cluster.devices_per_node, cluster.devices)
    fabric = cluster.fabric
    if fabric is not None and fabric.pod_nodes < cluster.nodes and size > 1:
        pods = _pods_spanned(stride, size, cluster.devices_per_node * fabric.pod_nodes, cluster.devices)
        if pods > 1:
            placement = dataclasses.replace(placement, pods=pods)
    return placement


@functools.lru_cache(maxsize=1024)
def _pods_spanned(stride: int, size: int, pod_devices: int, devices: int) -> int:
    """The most pods any group ``{base + k * stride : k < size}`` spans, pods of ``pod_devices`` consecutive ranks."""
    ranks = np.arange(devices, dtype=np.int64)
    group = ranks - ((ranks // stride) % size) * stride
    pods = devices // pod_devices + (devices % pod_devices > 0)
    pairs = np.unique(group * pods + ranks // pod_devices)
    return int(np.bincount(pairs // pods).max())


def _rank_nic_bandwidth(group: GroupPlacement, cluster: Cluster, kind: Collective) -> float:
    """One rank's achievable share of its node's NICs, bytes/s (``b`` in the module docstring).
    A measured fit of ``kind`` on the inter-node link is already achievable: it is shared as is."""
    inter, intra = cluster.inter_node, cluster.intra_node
    sharing = cluster.devices_per_node / (group.ranks_per_node * group.groups_per_node)
    if kind.value in inter.collectives:
        return min(inter.achievable(kind.value) * sharing, intra.achievable(kind.value))
    return min(inter.bandwidth * sharing, intra.bandwidth) * inter.efficiency


def _check(nbytes: float, group: GroupPlacement, cluster: Cluster) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) \
            or nbytes < 0:
        raise ConfigError(f"nbytes={nbytes!r} must be a finite number of bytes >= 0")
    # ``group.nodes`` may exceed ``cluster.nodes``: place_axes prices a group that lands unevenly
    # (e.g. 3 ranks as 2 + 1 on two nodes) as if spread one rank per node, which can count more nodes
    # than the cluster has; that is the conservative price, not a placement error.
    dpn = cluster.devices_per_node
    if group.pods > 1 and cluster.fabric is None:
        raise ConfigError(f"{group} spans {group.pods} pods, but {cluster.describe()} has no fabric of pods: build "
                          "placements with place_axes() on the cluster they are priced on")
    if group.ranks_per_node * group.groups_per_node > dpn:
        raise ConfigError(f"{group} does not fit {cluster.describe()}: ranks_per_node * groups_per_node must be "
                          f"<= {dpn}; build placements with place_axes()")


def collective_time(kind: Collective, nbytes: float, group: GroupPlacement, cluster: Cluster) -> float:
    """Seconds for one collective of ``nbytes`` per-rank bytes over ``group`` (see the module docstring).

    A group of one rank costs 0, and so do 0 bytes; p2p ignores the group size and
    uses the inter-node link when the group spans several nodes (a pipeline runs at
    its slowest hop), the intra-node link otherwise.
    """
    kind = Collective.of(kind)
    _check(nbytes, group, cluster)
    # a search asks for a few hundred distinct times tens of thousands of times (HF GPT-2 175B's: 714 in 36,210)
    hit = _TIMES.get((kind, nbytes, group, id(cluster)))
    if hit is not None and hit[0] is cluster:
        return hit[1]
    if nbytes == 0 or (kind is not Collective.P2P and group.size == 1):
        t = 0.0
    elif kind is Collective.P2P:
        t = p2p_time(nbytes, cluster, across_nodes=group.nodes > 1)
    else:
        t = min(alpha + beta * nbytes for alpha, beta in collective_lines(kind, group, cluster))
    return _keep(_TIMES, _TIMES_KEPT, (kind, nbytes, group, id(cluster)), cluster, t)


def collective_lines(kind: Collective, group: GroupPlacement, cluster: Cluster) -> tuple[tuple[float, float], ...]:
    """``(alpha, beta)`` of every way ``kind`` may run over ``group`` (protocol x algorithm): one call of
    ``S > 0`` bytes takes ``min(alpha + beta * S)`` seconds, the form vectorised code (data-parallel
    buckets and ZeRO gathers in the stage partition DP) evaluates on arrays. Not for p2p."""
    kind = Collective.of(kind)
    # a plan's search prices the same few groups tens of thousands of times (0.8 of the 2.0 s that building a
    # tiny Llama's sharding ILPs for 32 A100s took, measured)
    hit = _LINES.get((kind, group, id(cluster)))
    if hit is not None and hit[0] is cluster:
        return hit[1]
    return _keep(_LINES, _LINES_KEPT, (kind, group, id(cluster)), cluster, _lines(kind, group, cluster))


# collective_lines' and collective_time's answers, keyed on the cluster's identity, not its value: hashing a
# Cluster (its links' protocol tables) costs as much as the lines. Each entry holds its cluster, so no other
# object can take that id while the entry is there (a lookup checks it is the same object).
_LINES: dict[tuple, tuple] = {}
_LINES_KEPT = 4096
_TIMES: dict[tuple, tuple] = {}
_TIMES_KEPT = 65536


def _keep(store: dict, kept: int, key: tuple, cluster: Cluster, value):
    """``value`` kept in ``store`` under ``key`` with its cluster (emptied first when it holds ``kept``)."""
    if len(store) >= kept:
        store.clear()
    store[key] = (cluster, value)
    return value


def _lines(kind: Collective, group: GroupPlacement, cluster: Cluster) -> tuple[tuple[float, float], ...]:
    _check(0.0, group, cluster)
    n, r, N = group.size, group.ranks_per_node, group.nodes
    if n == 1:
        return ((0.0, 0.0),)
    intra, inter = cluster.intra_node, cluster.inter_node
    b_intra = intra.achievable(kind.value) * intra.group_share(r)
    context = _context(group, cluster)
    sigma = cluster.fabric.oversubscription if group.pods > 1 else 1.0   # the tier above the pods (Cluster.fabric)
    if kind is Collective.ALL_TO_ALL:
        beta = (r - 1) / n / b_intra
        if N > 1:   # of the ranks off the node, those in other pods over the tier above: 1 / sigma of the NICs
            b = _rank_nic_bandwidth(group, cluster, kind)
            in_pod = n / group.pods
            beta += (in_pod - r) / n / b + (n - in_pod) / n / (b / sigma)
        a_intra, a_inter = intra.step_latency(kind.value), inter.step_latency(kind.value)
        return ((context + (r - 1) * a_intra + (n - r) * a_inter, beta),)
    volume = {Collective.ALL_REDUCE: 2 * (n - 1) / n, Collective.BROADCAST: 1.0}.get(kind, (n - 1) / n)
    passes = 2 if kind is Collective.ALL_REDUCE else 1
    b_nic = _rank_nic_bandwidth(group, cluster, kind) if N > 1 else 0.0
    lines = []
    for p_intra, p_inter in _protocol_pairs(intra, inter, kind, N):
        if N == 1:
            b_eff, base = b_intra * p_intra.bandwidth_fraction, p_intra.base_latency
            ring_pass = (n - 1) * p_intra.step_latency
        else:
            nic = b_nic * p_inter.bandwidth_fraction
            b_eff = nic if r == 1 else min(b_intra * p_intra.bandwidth_fraction, r * nic)
            if group.pods > 1:   # the ring's edge out of a pod: its N / P nodes' share of the tier above
                b_eff = min(b_eff, N / group.pods * r * nic / sigma)
            if N > 2 and p_inter.bus_bandwidth_cap > 0:
                b_eff = min(b_eff, p_inter.bus_bandwidth_cap)
            base = max(p_intra.base_latency, p_inter.base_latency)
            ring_pass = ((n - N) * max(p_intra.step_latency, p_inter.net_step_floor)
                         + (N - 1) * p_inter.step_latency)
        lines.append((context + base + passes * ring_pass, volume / b_eff))
        if kind is Collective.ALL_REDUCE and N > 1:   # double binary tree: up and down, log2 N levels
            depth = (r - 1) * p_intra.step_latency + math.ceil(math.log2(N)) * p_inter.step_latency
            lines.append((context + base + 2 * depth, 2 / b_eff))
    if kind is Collective.ALL_REDUCE and N == 1 and intra.sharp_bandwidth > 0 and kind.value not in intra.collectives:
        lines.append((context + intra.sharp_latency, volume / intra.sharp_bandwidth))
    return tuple(lines)


def _protocol_pairs(intra: Link, inter: Link, kind: Collective, nodes: int) -> list[tuple[Protocol, Protocol]]:
    """(intra-node, inter-node) protocol of each way a ring may run: one protocol runs over both
    levels (paired by name); a link without that protocol lends its own fastest-bandwidth one."""
    mine = intra.ring_protocols(kind.value)
    if nodes == 1:
        return [(p, p) for p in mine]
    theirs = {p.name: p for p in inter.ring_protocols(kind.value)}
    widest_intra = max(mine, key=lambda p: p.bandwidth_fraction)
    widest_inter = max(theirs.values(), key=lambda p: p.bandwidth_fraction)
    pairs = [(p, theirs.get(p.name, widest_inter)) for p in mine]
    pairs += [(widest_intra, q) for name, q in theirs.items() if name not in {p.name for p in mine}]
    return pairs


def p2p_time(nbytes: float, cluster: Cluster, *, across_nodes: bool) -> float:
    """Seconds to send ``nbytes`` from one rank to another: ``S / (bandwidth * efficiency) + latency``.

    ``across_nodes`` picks the inter-node link (one device's NIC) over the intra-node one.
    """
    _check(nbytes, GroupPlacement(size=1, ranks_per_node=1, groups_per_node=1), cluster)
    if nbytes == 0:
        return 0.0
    link: Link = cluster.inter_node if across_nodes else cluster.intra_node
    return nbytes / (link.achievable("p2p") * link.group_share(2)) + link.step_latency("p2p") + link.context_latency_p2p


def _context(group: GroupPlacement, cluster: Cluster) -> float:
    """Seconds a collective pays once for being issued between compute (``Link.context_latency``): of
    the intra-node link inside one node, of the slower level across nodes."""
    if group.nodes == 1:
        return cluster.intra_node.context_latency
    return max(cluster.intra_node.context_latency, cluster.inter_node.context_latency)


def bus_bandwidth(kind: Collective, nbytes: float, seconds: float, group_size: int) -> float:
    """nccl-tests bus bandwidth in bytes/s: ``nbytes * factor / seconds``.

    Factors: all-reduce ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all ``(n-1)/n``;
    broadcast and p2p 1. Useful to compare predictions with measured busbw tables.
    """
    kind, n = Collective.of(kind), group_size
    factor = {Collective.ALL_REDUCE: 2 * (n - 1) / n, Collective.BROADCAST: 1.0,
              Collective.P2P: 1.0}.get(kind, (n - 1) / n)
    return nbytes * factor / seconds
