"""What the memory benches (init_memory.py, step_memory.py) share: a rank's resident-set counters read from
``/proc/self/status``, its peak counter reset, and a spawn of gloo ranks that each write their figures to a
JSON file of a temporary folder. Linux only (``/proc``)."""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from typing import Any, Callable

import torch.multiprocessing as mp


def kib(field: str) -> int:
    """``field`` of /proc/self/status ("VmRSS", "VmHWM"), in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> int:
    """Reset the peak resident-set counter to the resident set now (VmHWM := VmRSS); return that, bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return kib("VmRSS")


def spawn(rank: Callable[..., None], args: tuple, world: int) -> list[dict[str, Any]]:
    """Run ``rank(r, port, *args, out)`` on ``world`` spawned processes (``port``: a free one for their process
    group; ``out``: a folder where rank ``r`` writes ``<r>.json``); return what each wrote, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank, args=(port, *args, out), nprocs=world, start_method="spawn")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]
