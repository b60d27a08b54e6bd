"""How busy the rest of the machine was while a bench measured: timings on a shared VM are only as
good as the machine is idle, so the timing benches print this beside their numbers."""

from __future__ import annotations

import os
import resource
import time


def busy_cpu_seconds() -> float:
    """CPU-seconds every process of this machine has used since boot (/proc/stat; 0 where unavailable)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds this process and its waited-for children have used."""
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in own)


class OtherLoad:
    """``with OtherLoad() as load: ...``; then ``load.wall`` (s) and ``load.others`` (CPU-s other
    processes used meanwhile)."""

    def __enter__(self) -> "OtherLoad":
        self._start, self._busy, self._own = time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._start
        self.others = max(0.0, busy_cpu_seconds() - self._busy - (own_cpu_seconds() - self._own))
