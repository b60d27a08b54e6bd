"""The conditions a machine profile was measured under, and when they make it noisy.

``Cluster.local`` measures this machine once and caches the measurement (profiler/local.py). A
measurement taken while other processes competed for the machine prices every later plan made on
it: a CPU closed loop (issue 50) read a 17% median error on a profile measured on an idle machine
and 43-44% on one cached at a busy moment, and picked a configuration 1.30x slower than the fastest.
So every measurement records what it was measured under (:class:`ProfileConditions`), plans record
it with their cluster (``Cluster.profile_conditions``), and a noisy one is measured again, then
warned about (:class:`~autopar.errors.NoisyProfileWarning`) or refused (``strict``).

What is recorded, from the operating system around the measurement (profiler/host.py's
``LoadMeter``; ``None`` where the system does not report it):

* ``other_load``: cores other processes kept busy on average while it ran: the machine's busy CPU
  time (``/proc/stat``) minus this process's and its children's (``getrusage``), over the wall time;
* ``own_load``: cores the measurement itself kept busy (its own CPU time over the wall time);
* ``wait_fraction``: the share of its threads' time spent ready to run but waiting for a core
  (the run-queue delay of ``/proc/self/task/*/schedstat``): the time other processes took from it;
* ``spread``: how far the timed repeats of one kernel disagree, ``(max - min) / median`` over a
  kernel's repeats, the median over the device profile's kernels (``None`` for the links, whose
  per-call times are bimodal by nature, see link_timing.py);
* ``flat``: the links only, the collectives whose fitted time does not grow with message size
  (profiler/links.py: ``beta = 0``). A link's time does grow from 1 KiB to 24 MiB, so a flat fit is
  what stalls on the small messages make of it (CI: an all-to-all of 4 KiB timed as long as one of
  16 MiB while a test suite ran beside it), and it has no bandwidth to price a plan with;
* ``load_average`` just before it (1 minute), the date, the torch version, the threads it ran and
  the machine's cores, and how many measurements it took (``attempts``: the least noisy is kept).

**Noisy** (:meth:`ProfileConditions.noise`) when any of:

* ``other_load > own_load`` (a CPU measurement): other processes used more CPU than the
  measurement. They then share the caches and the memory bandwidth with it whatever core each runs
  on, and where their demand exceeds the free cores they take its core. (A GPU's kernels do not
  share them: there the other two rules judge, its host thread's waits and the kernels' spread.)
* ``wait_fraction > WAIT_LIMIT``: the measurement itself lost more than that share of its time to
  other processes;
* ``spread > SPREAD_LIMIT``: its repeats disagree more than a quiet machine's do (a burst of load
  that comes and goes within the measurement, which the averaged loads can understate);
* ``flat`` names a collective: the measurement cannot be priced with (the most severe noise;
  ``Cluster.local`` refuses it, uncached, when every attempt has one).

The limits come from the device profile (1 thread, normal budget) measured again and again on a
shared 2-core VM while other jobs came and went (bench/profile_noise.py prints such runs):

other processes         runs   waited for a core   spread (median kernel)   fp32 GFLOP/s   GB/s
quiet: 0.05-0.63 cores  2      (not read)          0.09-0.12                81-83          13.8-14.5
the other core: 1.0-1.04 5     2.4-2.8% (2 read)   0.075-0.16               66-86          11.1-14.3
more: 1.35-1.88 cores   23     35-88%              0.31-1.56                44-74          2.3-10.6

The first rule flags the middle row (its streaming bandwidth fell up to 23%, one fp32 peak 20%),
the other two the last row; none flags the quiet one.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from .errors import ConfigError

FORMAT = 1
"""Version of the :meth:`ProfileConditions.to_dict` record."""
WAIT_LIMIT = 0.05
"""Largest share of its time the measurement may have waited for a core: half the closed loop's 10%
median error target (a kernel's time stretches by up to the share it waited); measured 2.4-2.8% with the
other core busy, 35-88% under more (module docstring)."""
SPREAD_LIMIT = 0.25
"""Largest median relative spread ((max - min) / median) of a kernel's timed repeats: twice a quiet
machine's largest (0.12), above the 0.16 seen with the other core busy, below the 0.31 and more of a
loaded one (module docstring)."""
MAX_ATTEMPTS = 3
"""Measurements ``Cluster.local`` takes at most before it keeps the least noisy and warns."""
REFRESH_ADVICE = "run `autopar profile --refresh` (or Cluster.local(refresh=True)) on an idle machine"


@dataclass(frozen=True, kw_only=True)
class ProfileConditions:
    """What one measurement of this machine (its device, or its links) was taken under (module docstring)."""

    part: str
    """What was measured: "device" or "links <backend> x<ranks>"."""
    device_type: str
    """What it computed on: "cpu" or "cuda" (other processes' CPU load counts against a CPU measurement only)."""
    measured_at: str
    """UTC time the measurement started, ISO 8601."""
    torch_version: str
    threads: int
    """Torch threads the measurement ran (the links: ranks x threads per rank)."""
    cores: int
    """Cores of the machine (``os.cpu_count()``)."""
    load_average: float | None
    """The 1-minute load average just before the measurement."""
    other_load: float | None
    """Cores other processes kept busy, on average over the measurement."""
    own_load: float | None
    """Cores the measurement kept busy, on average."""
    wait_fraction: float | None
    """Share of the measuring threads' time spent waiting for a core (0..1)."""
    spread: float | None
    """Median over the timed kernels of ``(max - min) / median`` of their repeats."""
    attempts: int = 1
    """Measurements taken; this is the least noisy of them."""
    flat: tuple[str, ...] = ()
    """The links: collectives whose fitted time does not grow with size (module docstring); () for the device."""

    def __post_init__(self) -> None:
        if isinstance(self.flat, list):     # a record read back from JSON
            object.__setattr__(self, "flat", tuple(self.flat))
        if not isinstance(self.flat, tuple) or not all(isinstance(k, str) and k for k in self.flat):
            raise ConfigError(f"ProfileConditions.flat={self.flat!r} must be a tuple of collective names")
        if self.device_type not in ("cpu", "cuda"):
            raise ConfigError(f"ProfileConditions.device_type={self.device_type!r} must be 'cpu' or 'cuda'")
        for name in ("part", "measured_at", "torch_version"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"ProfileConditions.{name}={getattr(self, name)!r} must be a non-empty string")
        try:
            _dt.datetime.fromisoformat(self.measured_at)
        except ValueError as exc:
            raise ConfigError(f"ProfileConditions.measured_at={self.measured_at!r} is not an ISO 8601 time") from exc
        for name in ("threads", "cores", "attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ProfileConditions.{name}={value!r} must be an integer >= 1")
        for name in ("load_average", "other_load", "own_load", "wait_fraction", "spread"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ConfigError(f"ProfileConditions.{name}={value!r} must be a finite number >= 0, or None "
                                  "(not measured)")

    def noise(self) -> tuple[str, ...]:
        """Why this measurement is noisy (module docstring), one phrase per reason; () when it is not."""
        reasons = []
        if self.device_type == "cpu" and self.other_load is not None and self.own_load is not None \
                and self.other_load > self.own_load:
            reasons.append(f"other processes kept {self.other_load:.2f} cores busy, more than the "
                           f"{self.own_load:.2f} it used")
        if self.wait_fraction is not None and self.wait_fraction > WAIT_LIMIT:
            reasons.append(f"it waited for a core {self.wait_fraction:.0%} of its time (limit {WAIT_LIMIT:.0%})")
        if self.spread is not None and self.spread > SPREAD_LIMIT:
            reasons.append(f"its repeats spread {self.spread:.0%} (limit {SPREAD_LIMIT:.0%})")
        if self.flat:
            reasons.append(f"the {', '.join(self.flat)} time did not grow with message size (stalls on the small "
                           "messages; no bandwidth can be fitted)")
        return tuple(reasons)

    @property
    def noisy(self) -> bool:
        return bool(self.noise())

    def severity(self) -> float:
        """How far past its limits this measurement is (the largest ratio of a quantity to its limit; other
        load against own load; infinite with a flat fit, which cannot be priced with): the least severe of
        several attempts is kept."""
        if self.flat:
            return math.inf
        ratios = [0.0]
        if self.device_type == "cpu" and self.other_load is not None and self.own_load is not None:
            ratios.append(self.other_load / max(self.own_load, 1e-9))
        if self.wait_fraction is not None:
            ratios.append(self.wait_fraction / WAIT_LIMIT)
        if self.spread is not None:
            ratios.append(self.spread / SPREAD_LIMIT)
        return max(ratios)

    def age_seconds(self, now: _dt.datetime | None = None) -> float:
        """Seconds since the measurement (``now``: default the current UTC time)."""
        now = now or _dt.datetime.now(_dt.timezone.utc)
        return (now - _dt.datetime.fromisoformat(self.measured_at)).total_seconds()

    def describe(self, now: _dt.datetime | None = None) -> str:
        """One line: when, under what load, how far its repeats spread, and the verdict."""
        def num(value: float | None, fmt: str) -> str:
            return "?" if value is None else format(value, fmt)

        text = (f"{self.part}: measured {self.measured_at} ({_age(self.age_seconds(now))} ago) with torch "
                f"{self.torch_version}, {self.threads} thread(s) of {self.cores} cores; other processes "
                f"{num(self.other_load, '.2f')} cores busy, the measurement {num(self.own_load, '.2f')}; "
                f"waited for a core {num(self.wait_fraction, '.1%')}; 1-min load before "
                f"{num(self.load_average, '.2f')}")
        if self.spread is not None:
            text += f"; repeats spread {self.spread:.1%}"
        if self.attempts > 1:
            text += f"; the least noisy of {self.attempts} measurements"
        noise = self.noise()
        return text + (f"; NOISY: {'; '.join(noise)}" if noise else "; clean")

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT} | asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProfileConditions":
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ConfigError(f"profile conditions {data!r} are not of format {FORMAT}: measure again "
                              f"({REFRESH_ADVICE})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"format"})
        missing = sorted(known - set(data) - {"attempts", "flat"})
        if unknown or missing:
            raise ConfigError(f"profile conditions {dict(data)!r}: unknown fields {unknown}, missing {missing}; "
                              f"measure again ({REFRESH_ADVICE})")
        return cls(**{k: v for k, v in data.items() if k != "format"})


def noisy_profile_warning(conditions: Sequence[ProfileConditions]) -> str | None:
    """The warning line for a cluster measured under ``conditions``: None when every one is clean."""
    noisy = [c for c in conditions if c.noisy]
    if not noisy:
        return None
    parts = "; ".join(f"the {c.part} measured {c.measured_at}: {', '.join(c.noise())}" for c in noisy)
    return f"the machine profile is noisy ({parts}): its times may be off; {REFRESH_ADVICE}"


def _age(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if abs(seconds) >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
