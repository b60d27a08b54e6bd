"""Pipeline schedules as lists of small actions, checked and simulated without communication.

A pipeline of ``p`` devices runs ``S = p v`` model chunks ("stages" here). Chunk ``s`` lives on
device ``s mod p`` (``v`` chunks per device when interleaved), except under ZB-V, which places
device ``d``'s two chunks as a V: ``d`` and ``2 p - 1 - d`` (:func:`device_of`), as does DualPipeV. An
:class:`Action` is one pass of one micro-batch through one chunk: a forward (``F``), a whole
backward (``B``), or, in the zero-bubble schedules, a backward split in two (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR 2024): the input gradient (``I``, what the previous chunk
waits for) and the weight gradient (``W``, which nothing waits for, so it can fill a bubble).
A schedule is, per device, the order in which that device runs its actions. Dependencies
(what p2p carries):

- ``F(s, i)`` needs ``F(s - 1, i)`` (its input activation), for ``s > 0``;
- ``B(s, i)`` and ``I(s, i)`` need ``F(s, i)`` and, for ``s < S - 1``, the input gradient of ``(s + 1, i)``
  (its output gradient): whichever of ``B(s + 1, i)`` and ``I(s + 1, i)`` the schedule runs; ``W(s, i)``
  needs ``I(s, i)``.

A device blocks on its next action until that action's dependencies are done (a blocking
receive), so a schedule deadlocks exactly when no device's next action is ready:
:func:`check` finds that by simulation, before any process group exists.

Orders (Narayanan et al., SC21, section 2; torch.distributed.pipelining for the zero-bubble ones):

- GPipe: every forward, then every backward (micro-batch order);
- 1F1B: ``min(m, p - d - 1)`` warm-up forwards on device ``d``, then one forward / one
  backward alternately, then the remaining backwards;
- interleaved 1F1B (Megatron-LM's order): forward step ``k`` of a device runs chunk
  ``(k // p) mod v`` of that device on micro-batch ``(k // (p v)) p + k mod p``; backward step
  ``k`` the same with the chunk order reversed; warm-up ``min(m v, 2 (p - d - 1) + (v - 1) p)``
  forwards. It needs ``m`` to be a multiple of ``p``.
- ZB-H1 (``ScheduleInterleavedZeroBubble`` with one chunk per device): 1F1B's order with each
  ``B`` an ``I``; device ``d`` runs each ``W`` right after its ``I`` once ``d`` steady steps are
  past, so the last devices defer ``W``s into the drain, where 1F1B's bubble is;
- ZB-V (``ScheduleZBVZeroBubble``): per device ``2 (p - d) - 1`` forwards of its first chunk,
  ``d`` pairs of forwards (second chunk, first chunk), ``p - d`` of (``F``, ``I``, ``W``) on its
  second chunk, then steady rounds of ``F I W`` on each chunk, and a drain of ``I``s with the
  ``W``s last.
- DualPipeV (``ScheduleDualPipeV``, after DeepSeek-V3's DualPipe, arXiv 2412.19437): ZB-V's V with
  ``m >= 2p``; per device ``2 (p - d - 1)`` forwards of its first chunk, ``d + 1`` pairs of forwards (first,
  second), ``p - d - 1`` of (``I``, the oldest pending ``W``, ``F``) on its second chunk, then steady
  pairs of one chunk's forward and the other chunk's whole backward (torch's ``OVERLAP_F_B`` actions,
  whose two passes its runtime runs one after the other, as here: the overlap of one's communication
  with the other's compute that DeepSeek's kernels get is neither run nor priced), and a drain whose
  later backwards are split (``I``), their ``W``s filling the end. A pass is a ``B`` or an ``I`` and a
  ``W``: :func:`check` accepts either.

:func:`simulate` gives the makespan for per-action durations and each device's peak number
of micro-batch activations held (forwards done whose backward, or weight-gradient pass, is
not), which the cost model's ``pipeline_time`` and ``in_flight`` formulas must agree with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..config import SCHEDULES, SPLIT_BACKWARD, V_SHAPED, check_choice, check_int
from .errors import ConfigError



@dataclass(frozen=True, order=True)
class Action:
    """One pass of micro-batch ``micro_batch`` through chunk ``stage``: forward ("F"), backward ("B"), or a
    backward's input-gradient ("I") or weight-gradient ("W") half."""

    stage: int
    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro_batch}"


Schedule = tuple[tuple[Action, ...], ...]   # per device, in execution order


def build(kind: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The action order of every pipeline device for schedule ``kind``."""
    _check_args(kind, pp, micro_batches, virtual_stages)
    if kind == "gpipe":
        return tuple(_gpipe(d, pp, micro_batches) for d in range(pp))
    if kind == "1f1b":
        return tuple(_one_f_one_b(d, pp, micro_batches) for d in range(pp))
    if kind == "zbh1":
        return tuple(_zero_bubble_h1(d, pp, micro_batches) for d in range(pp))
    if kind == "zbv":
        return tuple(_zero_bubble_v(d, pp, micro_batches) for d in range(pp))
    if kind == "dualpipev":
        return tuple(_dual_pipe_v(d, pp, micro_batches) for d in range(pp))
    return tuple(_interleaved(d, pp, micro_batches, virtual_stages) for d in range(pp))


def device_of(kind: str, stage: int, pp: int) -> int:
    """The pipeline device running chunk ``stage`` under schedule ``kind`` (ParallelConfig.chunk_device)."""
    if kind in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def least_micro_batches(kind: str, pp: int) -> int:
    """The fewest micro-batches schedule ``kind`` runs on ``pp`` devices: DualPipeV ``2 pp`` (torch's
    ScheduleDualPipeV refuses fewer: its steady pairs need one micro-batch per chunk in flight), else 1."""
    return 2 * pp if kind == "dualpipev" else 1


def _check_args(kind: str, pp: int, m: int, v: int) -> None:
    check_choice("schedule", kind, SCHEDULES)
    for name, value in (("pp", pp), ("micro_batches", m), ("virtual_stages", v)):
        check_int(name, value, 1)
    if kind in V_SHAPED and v != 2:
        raise ConfigError(f"schedule={kind!r} needs virtual_stages=2 (got {v})")
    if kind not in ("interleaved", *V_SHAPED) and v != 1:
        raise ConfigError(f"virtual_stages={v} needs schedule='interleaved'")
    check_micro_batches(kind, pp, m)


def runs_micro_batches(kind: str, pp: int, m: int) -> bool:
    """Whether schedule ``kind`` runs ``m`` micro-batches per pipeline on ``pp`` devices (:func:`check_micro_batches`
    says why not)."""
    return not (kind == "interleaved" and m % pp) and m >= least_micro_batches(kind, pp)


def check_micro_batches(kind: str, pp: int, m: int) -> None:
    """Raise ConfigError unless schedule ``kind`` runs ``m`` micro-batches per pipeline on ``pp`` devices."""
    if kind == "interleaved" and m % pp:
        raise ConfigError(f"the interleaved schedule needs the micro-batches per pipeline ({m}) to be a multiple "
                          f"of pp={pp} (Megatron-LM's order): lower micro_batch_size or raise the global batch")
    if m < least_micro_batches(kind, pp):
        raise ConfigError(f"schedule={kind!r} needs at least 2 x pp = {least_micro_batches(kind, pp)} micro-batches "
                          f"per pipeline (got {m}; torch's ScheduleDualPipeV refuses fewer): lower micro_batch_size, "
                          "raise the global batch, or use schedule='zbv'")


def _gpipe(d: int, p: int, m: int) -> tuple[Action, ...]:
    return tuple(Action(d, "F", i) for i in range(m)) + tuple(Action(d, "B", i) for i in range(m))


def _one_f_one_b(d: int, p: int, m: int) -> tuple[Action, ...]:
    warm = min(m, p - d - 1)
    out = [Action(d, "F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out += [Action(d, "F", f), Action(d, "B", b)]
        f, b = f + 1, b + 1
    out += [Action(d, "B", i) for i in range(b, m)]
    return tuple(out)


def _zero_bubble_h1(d: int, p: int, m: int) -> tuple[Action, ...]:
    """torch's ``_get_1f1b_rank_ops`` with zero bubble and one local chunk: warm-up ``min(m, p - d - 1)``
    forwards, then ``F I`` (steady) and ``I`` (drain) steps, each followed by the oldest pending ``W``
    once ``d`` steps are past the warm-up; the rest of the ``W``s at the end."""
    warm = min(m, p - d - 1)
    out = [Action(d, "F", i) for i in range(warm)]
    b = w = 0
    for step in range(m):   # the steady steps, then the drain's
        if warm + step < m:
            out.append(Action(d, "F", warm + step))
        out.append(Action(d, "I", b))
        b += 1
        if step >= d:
            out.append(Action(d, "W", w))
            w += 1
    out += [Action(d, "W", i) for i in range(w, m)]
    return tuple(out)


def _zero_bubble_v(d: int, p: int, m: int) -> tuple[Action, ...]:
    """torch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (its order for
    ``max(m, 2 p - 1)`` micro-batches, keeping those below ``m``)."""
    n = max(2 * p - 1, m)
    first, second = d, 2 * p - 1 - d
    out: list[Action] = []
    done: dict[tuple[int, str], int] = {}   # (chunk, kind) -> its passes so far: the next one's micro-batch

    def add(stage: int, *kinds: str) -> None:
        for kind in kinds:
            i = done.get((stage, kind), 0)
            done[(stage, kind)] = i + 1
            out.append(Action(stage, kind, i))

    def count(stage: int, kind: str) -> int:
        return done.get((stage, kind), 0)

    for _ in range(2 * (p - d) - 1):
        add(first, "F")
    for _ in range(d):
        add(second, "F")
        add(first, "F")
    for _ in range(p - d):
        add(second, "F", "I", "W")
    while count(second, "F") < count(first, "F") or count(first, "F") < n:
        if count(first, "F") < n:
            add(first, "F")
        add(first, "I", "W")
        add(second, "F", "I", "W")
    for _ in range(d):
        add(first, "I")
        add(second, "I")
    for _ in range(p - d):
        add(first, "I", "W")
    for stage in (second, first):   # the weight passes left, the second chunk's first
        while count(stage, "W") < count(stage, "I"):
            add(stage, "W")
    return tuple(a for a in out if a.micro_batch < m)


def _dual_pipe_v(d: int, p: int, m: int) -> tuple[Action, ...]:
    """torch's ``ScheduleDualPipeV._calculate_single_rank_operations`` with each ``OVERLAP_F_B`` pair as its
    forward then its whole backward (the order its runtime runs them in), for ``m >= 2p``."""
    first, second = d, 2 * p - 1 - d
    out: list[Action] = []
    done: dict[tuple[int, str], int] = {}   # (chunk, "F" / "I" / "W") -> its passes so far; a "B" counts as I and W
    weights: list[tuple[int, int]] = []     # the input-gradient passes whose weight pass is still to run, oldest first

    def add(stage: int, kind: str) -> None:
        i = done.get((stage, "I" if kind == "B" else kind), 0)
        out.append(Action(stage, kind, i))
        for counted in ("I", "W") if kind == "B" else (kind,):
            done[(stage, counted)] = done.get((stage, counted), 0) + 1
        if kind == "I":
            weights.append((stage, i))

    def weight() -> None:
        if weights:
            stage, i = weights.pop(0)
            out.append(Action(stage, "W", i))

    for _ in range(2 * (p - d - 1)):
        add(first, "F")
    for _ in range(d + 1):
        add(first, "F")
        add(second, "F")
    for _ in range(p - d - 1):
        add(second, "I")
        weight()
        add(second, "F")
    for _ in range(m - 2 * p + d + 1):   # the steady pairs (torch's first pair on the last device is not one)
        add(first, "F")
        add(second, "B")
        add(second, "F")
        add(first, "B")
    for _ in range(p - d - 1):
        add(second, "B")
        add(second, "F")
        add(first, "B")
    split = False
    for i in range(d + 1):   # the drain's backwards split from its middle on, the odd devices' a pass earlier
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        add(second, "I" if split else "B")
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        add(first, "I" if split else "B")
    for _ in range(p - d - 1):
        weight()
        add(first, "I" if split else "B")
    for _ in range(d + 1):
        weight()
    return tuple(out)


def _interleaved(d: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    total = m * v

    def step(k: int, backward: bool) -> Action:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return Action(chunk * p + d, "B" if backward else "F", (k // (p * v)) * p + k % p)

    warm = min(total, 2 * (p - d - 1) + (v - 1) * p)
    out = [step(k, False) for k in range(warm)]
    f, b = warm, 0
    while f < total:
        out += [step(f, False), step(b, True)]
        f, b = f + 1, b + 1
    out += [step(k, True) for k in range(b, total)]
    return tuple(out)


GRADIENT = "G"
"""The kind :func:`dependencies` names a chunk's input gradient by: done when its ``B`` or its ``I`` is."""


def dependencies(action: Action, stages: int) -> tuple[Action, ...]:
    """What ``action`` waits for (see the module docstring); a next chunk's input gradient as ``(s + 1, "G", i)``."""
    s, i, kind = action.stage, action.micro_batch, action.kind
    if kind == "F":
        return (Action(s - 1, "F", i),) if s > 0 else ()
    if kind == "W":
        return (Action(s, "I", i),)
    deps = [Action(s, "F", i)]
    if s < stages - 1:
        deps.append(Action(s + 1, GRADIENT, i))
    return tuple(deps)


def kinds_of(kind: str) -> tuple[str, ...]:
    """The ways schedule ``kind`` may run one chunk's pass of one micro-batch, each as its action kinds:
    "FB"; "FIW" when it splits the backward; either under DualPipeV."""
    if kind == "dualpipev":
        return ("FB", "FIW")
    return ("FIW",) if kind in SPLIT_BACKWARD else ("FB",)


def releases(action: Action) -> bool:
    """Whether ``action`` frees its forward's activations: a whole backward, or a weight-gradient pass
    (until it runs, the autograd graph the input-gradient pass kept holds them)."""
    return action.kind in "BW"


def check(schedule: Schedule, micro_batches: int, virtual_stages: int = 1, kind: str = "1f1b") -> None:
    """Raise ConfigError unless every (chunk, micro-batch) runs each pass of schedule ``kind``
    (:func:`kinds_of`) exactly once on its own device (:func:`device_of`) and the order completes
    without deadlock."""
    p = len(schedule)
    stages = p * virtual_stages
    seen: list[Action] = [a for actions in schedule for a in actions]
    ran: dict[tuple[int, int], str] = {}
    for a in seen:
        ran[(a.stage, a.micro_batch)] = ran.get((a.stage, a.micro_batch), "") + a.kind
    ways = kinds_of(kind)
    allowed = {"".join(sorted(w)) for w in ways}
    cells = set(ran) | {(s, i) for s in range(stages) for i in range(micro_batches)}
    wrong = [f"chunk {s} micro-batch {i} ran {ran.get((s, i), 'nothing')!r}" for s, i in sorted(cells)
             if not (0 <= s < stages and 0 <= i < micro_batches) or "".join(sorted(ran.get((s, i), ""))) not in allowed]
    if wrong:
        raise ConfigError(f"schedule does not run every chunk x micro-batch pass exactly once as one of "
                          f"{' / '.join(ways)}: missing, repeated or unexpected passes ({'; '.join(wrong[:4])})")
    for d, actions in enumerate(schedule):
        wrong = [str(a) for a in actions if device_of(kind, a.stage, p) != d]
        if wrong:
            raise ConfigError(f"device {d} runs chunks it does not hold: {wrong[:4]}")
    simulate(schedule, virtual_stages, lambda a: 1.0)


@dataclass(frozen=True)
class Simulation:
    makespan: float                 # seconds from the first forward to the last backward
    peak_in_flight: tuple[int, ...]  # per device: most forwards held without their backward (or W)
    times: Mapping[Action, tuple[float, float]] = field(default_factory=dict)  # (start, end) of each action


def simulate(schedule: Schedule, virtual_stages: int, duration: Callable[[Action], float]) -> Simulation:
    """Run the schedule on an idealised pipeline (zero-time p2p): each device starts its next
    action when it is free and the action's dependencies have finished. Raises ConfigError
    naming the blocked actions on deadlock."""
    p = len(schedule)
    stages = p * virtual_stages
    done: dict[Action, float] = {}
    times: dict[Action, tuple[float, float]] = {}
    pos = [0] * p
    clock = [0.0] * p
    held = [0] * p
    peak = [0] * p
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for d in range(p):
            while pos[d] < len(schedule[d]):
                action = schedule[d][pos[d]]
                deps = dependencies(action, stages)
                if any(dep not in done for dep in deps):
                    break
                start = max([clock[d]] + [done[dep] for dep in deps])
                clock[d] = done[action] = start + duration(action)
                if action.kind in "BI":
                    done[Action(action.stage, GRADIENT, action.micro_batch)] = clock[d]
                times[action] = (start, clock[d])
                held[d] += 1 if action.kind == "F" else -1 if releases(action) else 0
                peak[d] = max(peak[d], held[d])
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [f"device {d} waits at {schedule[d][pos[d]]}" for d in range(p) if pos[d] < len(schedule[d])]
            raise ConfigError(f"schedule deadlocks: {'; '.join(blocked[:6])}")
    return Simulation(max(clock), tuple(peak), times)


def makespan(kind: str, pp: int, micro_batches: int, virtual_stages: int, duration: Mapping[str, float]) -> float:
    """:func:`simulate`'s makespan of :func:`build`'s order when an action's duration depends on its kind alone
    (``duration["F"]`` ...: even devices), without the simulation: the order's dependency graph, walked once in
    a topological order (cached per schedule), gives each action's end as the latest of its device's previous
    action's and its dependencies' plus its own duration (a 64-device DualPipeV step in 6 ms, not 300, once its
    graph is built: 0.5 s)."""
    kinds, prev, deps = _compiled(kind, pp, micro_batches, virtual_stages)
    cost = [duration.get(k, 0.0) for k in ACTION_KINDS]
    end = [0.0] * len(kinds)
    for k, (before, needs) in enumerate(zip(prev, deps)):
        start = end[before] if before >= 0 else 0.0
        for j in needs:
            if end[j] > start:
                start = end[j]
        end[k] = start + cost[kinds[k]]
    return max(end, default=0.0)


ACTION_KINDS = "FBIW"


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """:func:`build`'s order as (kind index in ACTION_KINDS, the device's previous action or -1, the actions it
    waits for) per action, in the order :func:`simulate` runs them (a topological one)."""
    schedule = build(kind, pp, m, v)
    ran = simulate(schedule, v, lambda a: 1.0).times
    order = sorted(ran, key=lambda a: ran[a])   # the start times of unit actions: dependencies first
    index = {a: k for k, a in enumerate(order)}
    for a in order:
        if a.kind in "BI":
            index[Action(a.stage, GRADIENT, a.micro_batch)] = index[a]
    before = {}
    for actions in schedule:
        for a, b in zip(actions, actions[1:]):
            before[b] = index[a]
    stages = pp * v
    return (tuple(ACTION_KINDS.index(a.kind) for a in order), tuple(before.get(a, -1) for a in order),
            tuple(tuple(index[d] for d in dependencies(a, stages)) for a in order))


def format_schedule(schedule: Schedule) -> str:
    """One line per device, e.g. ``device 0: F0.0 F0.1 B0.0 ...``."""
    return "\n".join(f"device {d}: {' '.join(map(str, actions))}" for d, actions in enumerate(schedule))

