"""Profiler: measured op times, device curves and link fits of this machine, cached in a ProfileDB.

- ops.py: the model's own ops timed forward and backward (the cost model's MeasuredTimes);
- device.py: achieved FLOP/s curves and memory bandwidth, measured; device_profile.py: their records;
  device_fit.py: the Device fitted to them;
- link_timing.py: collectives between local ranks timed in one spawn; step_conditions.py, in the
  same spawn: overlap, in-context latency, concurrency slowdown, tensor-parallel dispatch; links.py: their
  per-collective alpha/beta fits -> a measured Link;
- local.py: ``Cluster.local()``: all of it for this machine, cached;
- database.py: the JSON cache; host.py: timers, thread counts and the load around a measurement (what it
  records: autopar/conditions.py; progress bars: autopar/progress.py).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..hardware import Device
from .database import ProfileDB
from .host import accelerator, device_name
from .ops import OpProfiler

__all__ = ["ProfileDB", "OpProfiler", "op_profiler"]


def op_profiler(model: nn.Module, example_inputs: Any, loss_fn, graph, planned: Device,
                profile_db: str | os.PathLike | None = None, progress: bool = True) -> OpProfiler:
    """An OpProfiler of ``model`` on this machine, for a cluster of ``planned`` devices (which must be this
    machine's: ``Cluster.local``)."""
    here = accelerator()
    threads = max(1, planned.threads)
    name = device_name(here, threads)
    if planned.name != name:
        raise ConfigError(f"profile=True times the model's ops on this machine ({name}), but the cluster's devices "
                          f"are {planned.name!r}: plan with cluster=autopar.Cluster.local(...) to profile, "
                          "or leave profile=False to use the analytic cost model for that cluster")
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        raise ConfigError("profile=True runs the model's ops, but the model is on the meta device: build it with "
                          "real weights, or leave profile=False")
    devices = {p.device for p in params}
    if devices and devices != {here}:
        raise ConfigError(f"profile=True times ops on {here}, but the model's parameters are on "
                          f"{sorted(map(str, devices))}: move the model there first (model.to({str(here)!r}))")
    return OpProfiler(model, example_inputs, graph, name, ProfileDB(profile_db), loss_fn=loss_fn, threads=threads,
                      kernel_overhead=planned.kernel_overhead, progress=progress, device=here)
