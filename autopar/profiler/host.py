"""This machine: its device's name, the timer and the thread count.

Timing: ``warmup`` untimed calls, then ``repeats`` timed ones, and the median. On a CPU
each call is timed with ``time.perf_counter`` (the ops run synchronously); on a GPU with
CUDA events around each call, then one synchronisation, so the host's launch time is not
counted where the GPU is the bottleneck.
"""

from __future__ import annotations

import contextlib
import platform
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


def median_time(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
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
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
