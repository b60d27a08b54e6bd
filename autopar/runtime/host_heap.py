"""A CPU rank's heap: keep what a step frees for the next step, rather than returning it to the system.

glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised up to 32 MiB as such
blocks are freed) with a mapping of its own, unmapped when freed, and hands free memory at the top of
its heap back to the system once it exceeds the trim threshold. A training step allocates and frees the
same buffers every step (activations, gradients, the optimizer's temporaries of a parameter's size), so
on a CPU rank each step faults their pages in again and the kernel zeroes them: 4,000-8,000 minor
faults a step for bench/runtime_overhead.py's 4-block MLP at hidden 512, and a compiled chunk, whose
buffers are freed in another order, more than the same chunk eager (BENCHMARKS.md, runtime overhead).

:func:`keep_freed_memory` fixes both thresholds (``mallopt``): blocks up to 32 MiB (glibc's most) come
from the heap, and the heap is trimmed only past 1 GiB of free memory at its top. A step's buffers are
then reused from one step to the next. Both drivers call it for a rank on the CPU (a GPU rank's buffers
come from torch's caching allocator, on the device). It acts on glibc alone (musl, macOS: nothing to
set) and only on the process that calls it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20    # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): larger is refused
TRIM_THRESHOLD = 1 << 30

_set: bool | None = None


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed blocks up to 32 MiB in its heap (module docstring), once;
    whether it is set (False where the C library is not glibc or refuses)."""
    global _set
    if _set is None:
        _set = False
        if platform.libc_ver()[0] == "glibc":
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _set = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _set
