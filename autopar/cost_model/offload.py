r"""Offloading (ParallelConfig.offload): states in host memory, the optimizer step on the CPU.

Two modes. ``offload="optimizer"`` (DeepSpeed's ``offload_optimizer``, Megatron-LM's
``--optimizer-cpu-offload``; runtime/optim.py's MasterOptimizer runs it) keeps the optimizer's states, and a
master copy of the weights it steps (fp32 under mixed precision with master weights, else the weights' own
dtype), in host memory; the device keeps its weights and gradients as without offload (sharded as the ZeRO
stage shards them). Once per step, after the gradients are reduced, each rank copies the gradient shard its
optimizer steps (``n_o`` parameters: ZeroShard's share for ZeRO >= 1, all it holds for ZeRO 0) to the host,
steps there, and copies the updated weights back, one after the other, with nothing to hide them:

    T_opt = b_g n_o / W_link + 28 n_o / (W_host e_stream) + b_w n_o / W_link

``offload="all"`` (with ZeRO-3: FSDP2's ``CPUOffloadPolicy``) keeps each rank's shards of the parameters
(in their own dtype, fp32 master weights under mixed precision: ``b_p`` bytes each), of their gradients
(the same dtype) and of the optimizer states in pinned host memory. Per unit and micro-batch, the parameter
shard crosses the host link to the device before each all-gather (forward, and again for backward), and
the reduced gradient shard crosses back after each reduce-scatter; the step's optimizer runs on the host's
CPU cores. With ``n`` parameters held by a device before ZeRO sharding over ``N_d`` ranks and the link's
achieved bandwidth ``W_link`` each way (Host.link_bandwidth):

    T_h2d = b_p n / (N_d W_link)   per gather        T_d2h = b_p n / (N_d W_link)   per reduce-scatter

They run on the gathers' and reductions' streams (FSDP2 copies in before its all-gather and out after its
reduce-scatter), so step_tail.py adds them to those collectives, under the same overlap; the step is
``T_opt = 28 n / (N_d W_host e_stream)``.

The CPU step streams each local parameter's fp32 master, gradient and two Adam moments, reading and writing
the master and the moments and reading the gradient (``CPU_ADAM_BYTES`` = 28 bytes), through the host's
memory at the share of its bandwidth that a streaming kernel reaches (HOST_STREAM_EFFICIENCY).

Device memory keeps no optimizer states ("optimizer"), or only the gathered units (estimator.buffer_bytes)
and no states ("all"); host memory must hold, per device, ``(2 b_m + K') n_o`` ("optimizer": the master
copy, its gradient in the master's dtype and the ``K'`` bytes of optimizer moments) or
``(b_p + b_g + K) n / N_d`` ("all") (Host.memory, the machine's DRAM over its accelerators).

A CPU device is its own host: "all" leaves its states where they were (the same memory), the copies are
memory copies at its streaming bandwidth, and the optimizer step is the one it runs anyway; "optimizer"
keeps the master copy beside the weights (its memory counts with the optimizer states), its gradient is
the device's own (same memory, same dtype: no copy), and the updated weights are copied back.
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
        raise ConfigError("offload keeps states in host memory, but device "
                          f"{device.name!r} describes no host: pass Device(host=Host(memory=..., memory_bandwidth=..., "
                          "link_bandwidth=..., source=...)) or plan with offload='none'")
    return host


def master_dtype_bytes(precision: Precision) -> float:
    """Bytes per parameter of the dtype the optimizer steps: fp32 under mixed precision with master weights,
    else the weights' own. What FSDP2 keeps sharded and copies under "all" (a parameter's shard and its
    gradient's), and the host copy runtime/optim.py's MasterOptimizer keeps under "optimizer"."""
    return float(precision.master_bytes or precision.weight_bytes)


def copy_time(device: Device, precision: Precision, cfg: ParallelConfig, shard_params):
    """Seconds to move ``shard_params`` parameters' shards (already divided by the ZeRO group) over the
    host link one way under ``offload="all"``; 0 otherwise. Floats or numpy arrays."""
    if cfg.offload != "all":
        return 0.0 * shard_params
    return shard_params * master_dtype_bytes(precision) / require_host(device).link_bandwidth


def cpu_step_time(device: Device, local_params):
    """Seconds of a CPU AdamW step over ``local_params`` parameters (the shard a rank holds)."""
    host = require_host(device)
    return local_params * CPU_ADAM_BYTES / (host.memory_bandwidth * HOST_STREAM_EFFICIENCY)


def optimizer_round_trip(device: Device, precision: Precision, local_params):
    """``offload="optimizer"``: seconds a rank spends on its ``local_params`` (the shard its optimizer steps)
    per step beyond the step itself: the gradients to the host and the updated weights back, over the host
    link (on a CPU, the weights' copy back alone: the gradient is already the host's)."""
    link = require_host(device).link_bandwidth
    moved = precision.weight_bytes + (0.0 if device.is_cpu else precision.grad_bytes)
    return local_params * moved / link


def host_bytes(precision: Precision, cfg: ParallelConfig, local_params):
    """Host memory a device's offloaded states take for the ``local_params`` parameters its optimizer steps (its
    ZeRO shard): the weights in the dtype stepped (under "all" FSDP2's shards, which are the master; under
    "optimizer" the host copy), their gradients in it, and the optimizer's moments; 0 without offload. Floats
    or numpy arrays."""
    if cfg.offload == "none":
        return 0.0 * local_params
    return local_params * (2 * master_dtype_bytes(precision) + precision.moment_bytes)
