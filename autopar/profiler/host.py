"""This machine: its device's name, the timer, the thread count and the load around a measurement.

Timing (:func:`call_times`, the timer of the device profile's kernels): ``warmup`` untimed calls,
then ``repeats`` timed ones. On a CPU each call is timed with ``time.perf_counter`` (the ops run
synchronously); on a GPU with CUDA events around each call, then one synchronisation, so the host's
launch time is not counted where the GPU is the bottleneck. :func:`median_time` is their median.

Load (:class:`LoadMeter`): what other processes did while a block ran, for the measurement's
:class:`~autopar.conditions.ProfileConditions` (Linux ``/proc``; ``None`` elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import time
from typing import Callable, Iterator

import torch

from ..errors import ConfigError


def accelerator() -> torch.device:
    """The device ranks of this machine compute on: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device, threads: int) -> str:
    """A name that identifies measurements of ``device``: a GPU's product name, or the CPU model with
    the threads per rank (CPU timings depend on it), e.g. "cpu AMD EPYC x1 thread"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {cpu_model()} x{threads} thread{'s' if threads != 1 else ''}"


def check_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads_per_rank={threads!r} must be an integer >= 1")
    return threads


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, restoring the old count after."""
    old = torch.get_num_threads()
    torch.set_num_threads(check_threads(threads))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def call_times(fn: Callable[[], object], device: torch.device, *, warmup: int = 2,
               repeats: int = 5) -> list[float]:
    """Seconds of each of ``repeats`` timed calls of ``fn()`` after ``warmup`` untimed ones."""
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    return statistics.median(call_times(fn, device, warmup=warmup, repeats=repeats))


def relative_spread(times: list[float]) -> float:
    """``(max - min) / median`` of repeated timings of one call (0 for one timing)."""
    middle = statistics.median(times)
    return (max(times) - min(times)) / middle if middle > 0 else 0.0


class LoadMeter:
    """``with LoadMeter() as meter:`` records the CPU other processes and this one used while the block ran.

    ``other_load`` / ``own_load``: cores kept busy on average (the machine's busy time from
    ``/proc/stat``, this process's and its reaped children's from ``getrusage``); ``wait_fraction``:
    the share of this process's threads' time spent waiting for a core (``schedstat``; threads
    that ended within the block cannot be read and are left out); ``load_average``: the 1-minute
    load average before. Each is None where the system does not report it.
    """

    def __enter__(self) -> "LoadMeter":
        self.load_average = _load_average()
        self.other_load = self.own_load = self.wait_fraction = None
        self._start = _snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        (wall0, busy0, own0, sched0), (wall1, busy1, own1, sched1) = self._start, _snapshot()
        wall = wall1 - wall0
        if wall <= 0:
            return
        self.own_load = max(0.0, (own1 - own0) / wall)
        if busy0 is not None and busy1 is not None:
            self.other_load = max(0.0, (busy1 - busy0 - (own1 - own0)) / wall)
        # a thread started within the block (torch's intra-op pool) ran and waited only within it
        deltas = [(ran - sched0.get(t, (0.0, 0.0))[0], wait - sched0.get(t, (0.0, 0.0))[1])
                  for t, (ran, wait) in sched1.items()]
        ran, waited = sum(r for r, _ in deltas), sum(w for _, w in deltas)
        if ran + waited > 0:
            self.wait_fraction = waited / (ran + waited)


def _snapshot() -> tuple[float, float | None, float, dict[str, tuple[float, float]]]:
    """(wall seconds, the machine's busy CPU seconds, this process's CPU seconds, its threads' schedstats)."""
    return time.monotonic(), _machine_busy_seconds(), _own_cpu_seconds(), _thread_schedstats()


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle, iowait = ticks[3], ticks[4] if len(ticks) > 4 else 0
    guest = sum(ticks[8:10])          # already counted in user and nice
    return (sum(ticks) - idle - iowait - guest) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its children that have been waited for."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _thread_schedstats() -> dict[str, tuple[float, float]]:
    """Per thread of this process: (seconds on a core, seconds waiting for one); {} without schedstat."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/self/task/{tid}/schedstat") as fh:
                    ran, waited = fh.read().split()[:2]
                out[tid] = (int(ran) / 1e9, int(waited) / 1e9)
    return out
