r"""Offloaded ZeRO-3 (ParallelConfig.offload): the states in host memory, the optimizer on the CPU.

FSDP2's ``CPUOffloadPolicy`` keeps each rank's shards of the parameters (in their own dtype, fp32 master
weights under mixed precision: ``b_p`` bytes each), of their gradients (the same dtype) and of the optimizer
states in pinned host memory. Per unit and micro-batch, the parameter shard crosses the host link to the
device before each all-gather (forward, and again for backward), and the reduced gradient shard crosses
back after each reduce-scatter; the step's optimizer runs on the host's CPU cores. With ``n`` parameters
held by a device before ZeRO sharding over ``N_d`` ranks and the link's achieved bandwidth ``W_link``
each way (Host.link_bandwidth):

    T_h2d = b_p n / (N_d W_link)   per gather        T_d2h = b_p n / (N_d W_link)   per reduce-scatter

They run on the gathers' and reductions' streams (FSDP2 copies in before its all-gather and out after its
reduce-scatter), so step_tail.py adds them to those collectives, under the same overlap. The CPU step
streams each local parameter's fp32 master, gradient and two Adam moments, reading and writing the master
and the moments and reading the gradient (``CPU_ADAM_BYTES`` = 28 bytes), through the host's memory at
the share of its bandwidth that a streaming kernel reaches (HOST_STREAM_EFFICIENCY):

    T_opt = 28 n / (N_d  W_host  e_stream)

Device memory keeps the gathered units (estimator.buffer_bytes) and no states; host memory must hold
``(b_p + b_g + K) n / N_d`` per device (Host.memory, the machine's DRAM over its accelerators).

A CPU device is its own host: its states stay where they were (the same memory), the copies are memory
copies at its streaming bandwidth, and the optimizer step is the one it runs anyway.
"""

from __future__ import annotations

from ..config import ParallelConfig, Precision
from ..errors import ConfigError
from ..hardware import Device, Host

CPU_ADAM_BYTES = 28.0
"""Bytes an AdamW step moves per fp32 parameter on the CPU: master, first and second moments read and
written (3 x 8), the gradient read (4)."""
HOST_STREAM_EFFICIENCY = 0.75
"""Share of a server's DRAM bandwidth a streaming kernel reaches (STREAM Triad on two-socket Xeon and EPYC
servers reaches 70-80% of the channels' rate, McCalpin's STREAM results); a fused CPU AdamW step streams at
Triad's rate (bench/offload.py measures both on this machine)."""


def host_of(device: Device) -> Host | None:
    """Where ``device`` offloads to: its Host; a CPU's own memory (shared with what it holds); None when
    not described."""
    if device.host is not None:
        return device.host
    if device.is_cpu:
        stream = device.memory_bandwidth * device.memory_efficiency
        return Host(memory=device.memory, memory_bandwidth=device.memory_bandwidth, link_bandwidth=stream / 2,
                    source="a CPU is its own host: a copy reads and writes its memory")
    return None


def require_host(device: Device) -> Host:
    """``device``'s host, or a ConfigError saying how to describe it."""
    host = host_of(device)
    if host is None:
        raise ConfigError(f"offload=True keeps states in host memory, but device {device.name!r} describes no host: "
                          "pass Device(host=Host(memory=..., memory_bandwidth=..., link_bandwidth=..., source=...)) "
                          "or plan with offload=False")
    return host


def shard_param_bytes(precision: Precision) -> float:
    """Bytes per parameter of a sharded (offloaded) parameter and of its gradient shard: the master dtype
    (fp32 with master weights), what FSDP2 keeps sharded and copies."""
    return 4.0 if precision.master_weights or precision.compute == "fp32" else float(precision.weight_bytes)


def copy_time(device: Device, precision: Precision, cfg: ParallelConfig, shard_params):
    """Seconds to move ``shard_params`` parameters' shards (already divided by the ZeRO group) over the
    host link one way; 0 without offload. Floats or numpy arrays."""
    if not cfg.offload:
        return 0.0 * shard_params
    return shard_params * shard_param_bytes(precision) / require_host(device).link_bandwidth


def cpu_step_time(device: Device, local_params):
    """Seconds of a CPU AdamW step over ``local_params`` parameters (the shard a rank holds)."""
    host = require_host(device)
    return local_params * CPU_ADAM_BYTES / (host.memory_bandwidth * HOST_STREAM_EFFICIENCY)


def host_bytes(precision: Precision, local_params) -> float:
    """Host memory the offloaded states of ``local_params`` parameters (a rank's shard) take."""
    b = shard_param_bytes(precision)
    return local_params * (2 * b + precision.optimizer_bytes - (4.0 if precision.master_weights else 0.0))
