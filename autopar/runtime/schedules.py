"""Pipeline schedules as lists of small actions, checked and simulated without communication.

A pipeline of ``p`` devices runs ``S = p v`` model chunks ("stages" here). Chunk ``s`` lives on
device ``s mod p`` (``v`` chunks per device when interleaved), except under ZB-V, which places
device ``d``'s two chunks as a V: ``d`` and ``2 p - 1 - d`` (:func:`device_of`). An
:class:`Action` is one pass of one micro-batch through one chunk: a forward (``F``), a whole
backward (``B``), or, in the zero-bubble schedules, a backward split in two (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR 2024): the input gradient (``I``, what the previous chunk
waits for) and the weight gradient (``W``, which nothing waits for, so it can fill a bubble).
A schedule is, per device, the order in which that device runs its actions. Dependencies
(what p2p carries):

- ``F(s, i)`` needs ``F(s - 1, i)`` (its input activation), for ``s > 0``;
- ``B(s, i)`` needs ``B(s + 1, i)`` (its output gradient), for ``s < S - 1``, and ``F(s, i)``;
  ``I(s, i)`` likewise with ``I(s + 1, i)``; ``W(s, i)`` needs ``I(s, i)``.

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

:func:`simulate` gives the makespan for per-action durations and each device's peak number
of micro-batch activations held (forwards done whose backward, or weight-gradient pass, is
not), which the cost model's ``pipeline_time`` and ``in_flight`` formulas must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..config import SCHEDULES, SPLIT_BACKWARD, check_choice, check_int
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
    return tuple(_interleaved(d, pp, micro_batches, virtual_stages) for d in range(pp))


def device_of(kind: str, stage: int, pp: int) -> int:
    """The pipeline device running chunk ``stage`` under schedule ``kind`` (ParallelConfig.chunk_device)."""
    if kind == "zbv" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def _check_args(kind: str, pp: int, m: int, v: int) -> None:
    check_choice("schedule", kind, SCHEDULES)
    for name, value in (("pp", pp), ("micro_batches", m), ("virtual_stages", v)):
        check_int(name, value, 1)
    if kind == "zbv" and v != 2:
        raise ConfigError(f"schedule='zbv' needs virtual_stages=2 (got {v})")
    if kind not in ("interleaved", "zbv") and v != 1:
        raise ConfigError(f"virtual_stages={v} needs schedule='interleaved'")
    if kind == "interleaved" and m % pp:
        raise ConfigError(f"the interleaved schedule needs the micro-batches per pipeline ({m}) to be a multiple "
                          f"of pp={pp} (Megatron-LM's order): change micro_batch_size or the global batch")


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


def dependencies(action: Action, stages: int) -> tuple[Action, ...]:
    """The actions ``action`` waits for (see the module docstring)."""
    s, i, kind = action.stage, action.micro_batch, action.kind
    if kind == "F":
        return (Action(s - 1, "F", i),) if s > 0 else ()
    if kind == "W":
        return (Action(s, "I", i),)
    deps = [Action(s, "F", i)]
    if s < stages - 1:
        deps.append(Action(s + 1, kind, i))
    return tuple(deps)


def kinds_of(kind: str) -> str:
    """The action kinds schedule ``kind`` runs per chunk and micro-batch: "FB", or "FIW" when it splits
    the backward."""
    return "FIW" if kind in SPLIT_BACKWARD else "FB"


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
    expected = {Action(s, k, i) for s in range(stages) for k in kinds_of(kind) for i in range(micro_batches)}
    seen: list[Action] = [a for actions in schedule for a in actions]
    if len(seen) != len(set(seen)) or set(seen) != expected:
        missing = sorted(expected - set(seen))[:4]
        extra = sorted(set(seen) - expected)[:4]
        raise ConfigError(f"schedule does not run every chunk x micro-batch pass ({kinds_of(kind)}) exactly once "
                          f"(missing {list(map(str, missing))}, unexpected {list(map(str, extra))})")
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


def format_schedule(schedule: Schedule) -> str:
    """One line per device, e.g. ``device 0: F0.0 F0.1 B0.0 ...``."""
    return "\n".join(f"device {d}: {' '.join(map(str, actions))}" for d, actions in enumerate(schedule))

