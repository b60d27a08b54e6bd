"""``autopar.sweep``: one model planned on several cluster sizes, side by side, to decide how many nodes to rent.

The model is captured once; every size is then solved on its own, as :func:`autopar.plan` does
(``solver.solve``), with the same global batch, so the rows compare. A size where nothing fits
gets a row that says why (the solver's message) instead of a plan. Each row keeps its plan and
the numbers derived from it, in SI units::

    tokens/s       = global batch x tokens per sample / step time      (Plan.tokens_per_second)
    MFU            = model FLOPs per step / (step time x GPUs x peak FLOP/s)   (Plan.mfu)
    time to train  = training tokens / tokens/s                        (seconds)
    GPU-hours      = GPUs x time to train / 3600
    cost           = GPU-hours x price per GPU-hour

Model FLOPs are the forward and backward FLOPs of one step's global batch without recomputation
(the captured graph's, so attention is counted); the peak is the device's dense peak at the
plan's compute dtype. The text table is report/sweep.py's, the chart viz/sweep.py's.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import nn

from .capture import capture
from .capture.export import LossFn
from .cluster import Cluster
from .config import DEFAULT_TIE_TOLERANCE, Precision
from .errors import ConfigError, InfeasiblePlanError
from .plan import Plan, sequence_tokens
from .plan.sweep import Sweep, SweepRow
from .progress import progress_bar
from .codegen.inputs import describe_inputs, with_inputs
from .solver import solve
from .solver.ahead import cores_taken
from .solver.choice import check_tolerance
from .solver.sharding import NODE_LIMIT
from .solver.space import check_fixed

HOUR = 3600.0

FORK = sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
"""Whether sizes may be solved in worker processes: forked, so that they share the captured graph and
re-import nothing. Elsewhere (macOS, Windows: spawn, which re-runs the caller's script) one after another."""

def sweep(model: nn.Module, cluster: Cluster, example_inputs: Any, *, nodes: Sequence[int],
          global_batch_size: int | None = None, global_batch_tokens: int | None = None,
          tokens: float | None = None, price_per_gpu_hour: float | None = None,
          tokens_per_sample: int | None = None, name: str | None = None,
          fixed: Mapping[str, Any] | None = None, precision: Precision | None = None,
          loss_fn: LossFn | None = None, time_limit: float | None = None,
          ilp_node_limit: int | None = NODE_LIMIT, tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
          workers: int | None = None, verbose: bool = True) -> Sweep:
    """The best plan of ``model`` on each cluster size in ``nodes``, as a :class:`Sweep` (smallest first).

    ``cluster`` is the kind of node: its device, devices per node and links; its node count is
    replaced by each of ``nodes`` (e.g. ``Cluster.from_spec("1x8xH100-SXM")``, ``nodes=[1, 2, 4,
    8, 16]``). The global batch is the same on every size: ``global_batch_size`` samples, or
    ``global_batch_tokens`` (a multiple of the sequence length). ``tokens`` (e.g. ``1e12``) adds
    the time to train that many tokens, and ``price_per_gpu_hour`` its cost. Tokens per sample are
    the sequence length of the example inputs' token ids (``sequence_tokens`` in plan.py);
    ``tokens_per_sample`` sets them for a model whose inputs are not token ids. ``name`` is what the
    table calls the model (default: its class name). ``fixed``, ``precision``, ``loss_fn``,
    ``time_limit`` (per size), ``ilp_node_limit`` and ``tie_tolerance`` are :func:`autopar.plan`'s. ``workers``
    processes solve the sizes side by side on Linux (default: one per size, at most one per usable CPU;
    1, and always elsewhere: one after another in this process); each solve is deterministic, so the
    plans are the same either way.

    Arguments that are wrong for every size raise ConfigError; a size where nothing fits (or a
    pinned field cannot be placed) gets a row with the reason instead of a plan."""
    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster must be an autopar.Cluster, the kind of node (e.g. "
                          f"Cluster.from_spec('1x8xH100-SXM')), got {type(cluster).__name__}")
    sizes = _check_nodes(nodes)
    if precision is not None and not isinstance(precision, Precision):
        raise ConfigError(f"precision must be an autopar.Precision, got {type(precision).__name__}")
    fixed = check_fixed(fixed)
    tie_tolerance = check_tolerance(tie_tolerance)
    time_limit = _positive("time_limit", time_limit)
    if ilp_node_limit is not None and (isinstance(ilp_node_limit, bool) or not isinstance(ilp_node_limit, int)
                                       or ilp_node_limit < 1):
        raise ConfigError(f"ilp_node_limit={ilp_node_limit!r} must be a positive number of nodes (or None: no limit)")
    seq = _tokens_per_sample(tokens_per_sample, example_inputs)
    batch = _global_batch(global_batch_size, global_batch_tokens, seq)
    tokens = _positive("tokens", tokens)
    price_per_gpu_hour = _positive("price_per_gpu_hour", price_per_gpu_hour)
    if tokens is not None and seq is None:
        raise ConfigError("tokens= needs the tokens per sample, but the example inputs have no token ids "
                          "(an integer [batch, sequence] tensor): pass tokens_per_sample=")
    if price_per_gpu_hour is not None and tokens is None:
        raise ConfigError("price_per_gpu_hour= prices the time to train tokens=: give tokens too (e.g. tokens=1e12)")

    workers = _workers(workers, len(sizes))
    precision = precision or Precision.for_device(cluster.device.name)
    peak = cluster.device.peak(precision.storage)
    graph = capture(model, example_inputs, loss_fn, progress=verbose)
    task = _Task(graph, cluster, batch, precision, fixed, time_limit, ilp_node_limit, tie_tolerance)
    solved = _solve_sizes(task, sizes, workers, verbose)
    rows = []
    for n in sizes:
        plan, error = solved[n]
        if plan is None:
            rows.append(SweepRow(nodes=n, gpus=n * cluster.devices_per_node, plan=None, error=error))
        else:
            rows.append(measure(with_inputs(plan, example_inputs), n, seq, tokens, price_per_gpu_hour))
    return Sweep(model_name=name or graph.model_name, device=cluster.device.name,
                 devices_per_node=cluster.devices_per_node, precision=precision.compute, peak_flops=peak,
                 global_batch_size=batch, tokens_per_sample=seq, tokens=tokens,
                 price_per_gpu_hour=price_per_gpu_hour, rows=tuple(rows))


# --- solving the sizes, here or in worker processes -------------------------------------------------
@dataclass(frozen=True)
class _Task:
    """What every size's solve shares (handed to forked workers as it is: nothing here is pickled)."""

    graph: Any                      # the captured OpGraph
    cluster: Cluster                # the node type; its node count is replaced
    global_batch_size: int
    precision: Precision
    fixed: Mapping[str, Any]
    time_limit: float | None
    ilp_node_limit: int | None
    tie_tolerance: float

    def solve(self, nodes: int, progress: bool) -> tuple[Plan | None, str | None]:
        """(the best plan, None) on ``nodes`` nodes, or (None, why there is none)."""
        cluster = dataclasses.replace(self.cluster, nodes=nodes)
        try:
            best, _ = solve(self.graph, cluster, self.global_batch_size, precision=self.precision, fixed=self.fixed,
                            time_limit=self.time_limit, progress=progress, ilp_node_limit=self.ilp_node_limit,
                            tie_tolerance=self.tie_tolerance)
        except (InfeasiblePlanError, ConfigError) as exc:   # of this size: the row says why
            return None, str(exc)
        return best, None


_WORKER_TASK: _Task | None = None
"""The task of a worker process (set once by its initializer; the parent never sets it)."""


def _init_worker(task: _Task) -> None:
    global _WORKER_TASK
    _WORKER_TASK = task
    # What the worker inherited (torch, the graph) lives as long as it does: out of the collector's
    # sight, the search's many small objects are collected without walking it again (about 15% faster).
    gc.freeze()
    cores_taken()   # the workers keep the cores busy: no search of theirs forks a process to bound ahead


def _solve_in_worker(nodes: int) -> tuple[int, dict[str, Any] | None, str | None]:
    """One size in a worker: the plan as a dict (a Plan does not pickle: its cluster's mapping is read-only)."""
    plan, error = _WORKER_TASK.solve(nodes, progress=False)
    return nodes, None if plan is None else plan.to_dict(), error


def _solve_sizes(task: _Task, sizes: tuple[int, ...], workers: int,
                 verbose: bool) -> dict[int, tuple[Plan | None, str | None]]:
    """Each size's (plan, error): in this process one after another, or in ``workers`` processes, each
    solve independent and deterministic (the same plans either way), the largest sizes first."""
    if workers == 1:
        return {n: task.solve(n, progress=verbose)
                for n in progress_bar(sizes, "cluster sizes", enabled=verbose and len(sizes) > 1)}
    out = {}
    # fork: the workers share the captured graph without pickling it and import nothing again
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                             initializer=_init_worker, initargs=(task,)) as pool:
        futures = [pool.submit(_solve_in_worker, n) for n in sorted(sizes, reverse=True)]
        for future in progress_bar(as_completed(futures), "cluster sizes", total=len(futures), enabled=verbose):
            n, data, error = future.result()
            out[n] = (None if data is None else Plan.from_dict(data), error)
    return out


def measure(plan: Plan, nodes: int, tokens_per_sample: int | None, tokens: float | None,
            price_per_gpu_hour: float | None) -> SweepRow:
    """The row of ``plan`` (module docstring's arithmetic)."""
    per_second = None if tokens_per_sample is None else plan.throughput * tokens_per_sample
    train = None if tokens is None or per_second is None else tokens / per_second
    gpu_hours = None if train is None else plan.devices * train / HOUR
    cost = None if gpu_hours is None or price_per_gpu_hour is None else gpu_hours * price_per_gpu_hour
    return SweepRow(nodes=nodes, gpus=plan.devices, plan=plan, step_time=plan.step_time,
                    samples_per_second=plan.throughput, tokens_per_second=per_second, mfu=plan.mfu,
                    peak_memory=plan.peak_memory, train_seconds=train, gpu_hours=gpu_hours, cost=cost)


# --- checking the arguments ------------------------------------------------------------------------
def _check_nodes(nodes: Sequence[int]) -> tuple[int, ...]:
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence) or not nodes:
        raise ConfigError(f"nodes={nodes!r} must be a non-empty list of node counts, e.g. [1, 2, 4, 8, 16]")
    bad = [n for n in nodes if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ConfigError(f"nodes={list(nodes)!r}: {bad[0]!r} is not a positive whole number of nodes")
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"nodes={list(nodes)!r} repeats a size: give each node count once")
    return tuple(sorted(nodes))


def _workers(workers: int | None, sizes: int) -> int:
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"workers={workers!r} must be a positive integer (1: solve the sizes in this process)")
    if not FORK:
        return 1
    if workers is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:              # not on Linux
            cpus = os.cpu_count() or 1
        return max(1, min(sizes, cpus))
    return min(workers, sizes)


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive number (or None)")
    return float(value)


def _tokens_per_sample(given: int | None, example_inputs: Any) -> int | None:
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise ConfigError(f"tokens_per_sample={given!r} must be a positive integer (the sequence length)")
        return given
    try:
        record = describe_inputs(example_inputs)
    except (AttributeError, TypeError):      # not a tensor, tuple or dict: capture will say so
        return None
    return sequence_tokens(record)


def _global_batch(samples: int | None, tokens: int | None, tokens_per_sample: int | None) -> int:
    if (samples is None) == (tokens is None):
        raise ConfigError("give the global batch once: global_batch_size= (samples) or global_batch_tokens= "
                          f"(tokens), got {'both' if samples is not None else 'neither'}")
    if samples is not None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"global_batch_size={samples!r} must be a positive integer (samples per step)")
        return samples
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ConfigError(f"global_batch_tokens={tokens!r} must be a positive integer (tokens per step)")
    if tokens_per_sample is None:
        raise ConfigError("global_batch_tokens= needs the tokens per sample, but the example inputs have no token "
                          "ids (an integer [batch, sequence] tensor): pass global_batch_size= or tokens_per_sample=")
    if tokens % tokens_per_sample:
        near = [k for k in (tokens // tokens_per_sample, tokens // tokens_per_sample + 1) if k >= 1]
        raise ConfigError(f"global_batch_tokens={tokens} is not a whole number of {tokens_per_sample}-token sequences: "
                          "use " + " or ".join(f"{k * tokens_per_sample} ({k} x {tokens_per_sample})" for k in near))
    return tokens // tokens_per_sample
