"""Pipeline schedules as lists of small actions, checked and simulated without communication.

A pipeline of ``p`` devices runs ``S = p v`` model chunks ("stages" here): chunk ``s`` lives on
device ``s mod p`` (``v`` chunks per device when interleaved). An :class:`Action` is one
forward (``F``) or backward (``B``) of one micro-batch through one chunk. A schedule is, per
device, the order in which that device runs its actions. Dependencies (what p2p carries):

- ``F(s, i)`` needs ``F(s - 1, i)`` (its input activation), for ``s > 0``;
- ``B(s, i)`` needs ``B(s + 1, i)`` (its output gradient), for ``s < S - 1``, and ``F(s, i)``.

A device blocks on its next action until that action's dependencies are done (a blocking
receive), so a schedule deadlocks exactly when no device's next action is ready:
:func:`check` finds that by simulation, before any process group exists.

Orders (Narayanan et al., SC21, section 2):

- GPipe: every forward, then every backward (micro-batch order);
- 1F1B: ``min(m, p - d - 1)`` warm-up forwards on device ``d``, then one forward / one
  backward alternately, then the remaining backwards;
- interleaved 1F1B (Megatron-LM's order): forward step ``k`` of a device runs chunk
  ``(k // p) mod v`` of that device on micro-batch ``(k // (p v)) p + k mod p``; backward step
  ``k`` the same with the chunk order reversed; warm-up ``min(m v, 2 (p - d - 1) + (v - 1) p)``
  forwards. It needs ``m`` to be a multiple of ``p``.

:func:`simulate` gives the makespan for per-action durations and each device's peak number
of micro-batch activations held (forwards done whose backward is not), which the cost
model's ``pipeline_time`` and ``in_flight`` formulas must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..config import SCHEDULES, check_choice, check_int
from .errors import ConfigError



@dataclass(frozen=True, order=True)
class Action:
    """One forward ("F") or backward ("B") of micro-batch ``micro_batch`` through chunk ``stage``."""

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
    return tuple(_interleaved(d, pp, micro_batches, virtual_stages) for d in range(pp))


def _check_args(kind: str, pp: int, m: int, v: int) -> None:
    check_choice("schedule", kind, SCHEDULES)
    for name, value in (("pp", pp), ("micro_batches", m), ("virtual_stages", v)):
        check_int(name, value, 1)
    if kind != "interleaved" and v != 1:
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
    s, i = action.stage, action.micro_batch
    if action.kind == "F":
        return (Action(s - 1, "F", i),) if s > 0 else ()
    deps = [Action(s, "F", i)]
    if s < stages - 1:
        deps.append(Action(s + 1, "B", i))
    return tuple(deps)


def check(schedule: Schedule, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ConfigError unless every (chunk, micro-batch) runs forward and backward exactly once
    on its own device and the order completes without deadlock."""
    p = len(schedule)
    stages = p * virtual_stages
    expected = {Action(s, k, i) for s in range(stages) for k in "FB" for i in range(micro_batches)}
    seen: list[Action] = [a for actions in schedule for a in actions]
    if len(seen) != len(set(seen)) or set(seen) != expected:
        missing = sorted(expected - set(seen))[:4]
        extra = sorted(set(seen) - expected)[:4]
        raise ConfigError(f"schedule does not run every chunk x micro-batch forward and backward exactly once "
                          f"(missing {list(map(str, missing))}, unexpected {list(map(str, extra))})")
    for d, actions in enumerate(schedule):
        wrong = [str(a) for a in actions if a.stage % p != d]
        if wrong:
            raise ConfigError(f"device {d} runs chunks it does not hold: {wrong[:4]}")
    simulate(schedule, virtual_stages, lambda a: 1.0)


@dataclass(frozen=True)
class Simulation:
    makespan: float                 # seconds from the first forward to the last backward
    peak_in_flight: tuple[int, ...]  # per device: most forwards held without their backward
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
                held[d] += 1 if action.kind == "F" else -1
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

