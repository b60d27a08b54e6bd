"""The Hugging Face registry sweep: each architecture captured, planned, and trained on 2 gloo ranks.

For one architecture of transformers' auto registries (autopar/models/shrink.py builds it at the
test size, dropout off): capture it on the meta device from a batch-1 example and plan it free
on ``1x2xcpu`` (the README's flow), then pin four configurations, dp=2, tp=2 (sequence
parallelism left to the planner), pp=2 1F1B (micro-batch 2) and dp=2 ZeRO-3, and train each
for STEPS AdamW steps on the session's 2-rank world (worlds.py), comparing loss, gradients and
parameters with one process accumulating over the same micro-batches (harness.check_matches).

Every cell is "ok", "refused" (an AutoparError: a clear refusal, its message kept) or "failed"
(anything else: a raw exception, or a result that differs from one process). A configuration
that differs in float32 gets a second look in float64 (float64_look): rounding the steps grow
passes there, a wrong program does not. bench/hf_coverage.py
sweeps every architecture and writes docs/coverage.md.

test_hf_sample.py runs a fixed sample of it in the suite. Known problem, why the sample holds only
architectures that pass: when a configuration fails on one rank in the middle of a step, its gloo
process groups outlive it, and destroying one later can block in gloo's destructor (a worker thread
waiting on the peer that left); the ranks then hang until the job's timeout. One job per
configuration with the groups torn down by the job is the fix, not built yet.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import adamw, check_matches, one_process, round_trip, test_cluster  # noqa: E402

STEPS = 3   # AdamW steps per configuration, as docs/coverage.md states (the suite's harness takes 2)

GLOBAL_BATCH = 8
BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=1, zero=0, recompute="none", schedule="1f1b", virtual_stages=1)
CONFIGS = {"dp": dict(dp=2, micro_batch_size=4), "tp": dict(tp=2, micro_batch_size=4),
           "pp": dict(pp=2, micro_batch_size=2), "zero3": dict(dp=2, zero=3, micro_batch_size=2)}
COLUMNS = ("capture", "plan", *CONFIGS)
JOB_TIMEOUT = 600.0
DIFFERS = "differs from one process"
ILP_SECONDS = 20.0   # per sharding ILP call, in the sweep only (the planner's default has no clock limit)
PLAN_SECONDS = 90.0  # the plan and the four pinned plans of one architecture together


@dataclass(frozen=True)
class Cell:
    status: str        # "ok", "refused", "failed", or "skipped" (an earlier column did not pass)
    detail: str = ""   # the refusal's or the failure's first line


def cell_of(exc: BaseException) -> Cell:
    """An error as a cell: autopar's errors are refusals, but two are failures here: a PlanMismatchError, where
    every plan is made from the very model it runs (its advice, re-plan on this model, cannot be followed), and a
    RuntimeFailure, a program that failed while it ran (what it wraps: a raw exception, a rank that died)."""
    from autopar.errors import AutoparError, PlanMismatchError, RuntimeFailure
    line = (str(exc).strip().splitlines() or [""])[0][:300]
    if isinstance(exc, AutoparError) and not isinstance(exc, (PlanMismatchError, RuntimeFailure)):
        return Cell("refused", f"{type(exc).__name__}: {line}")
    return Cell("failed", f"{type(exc).__name__}: {line}")


def _quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()


def build(arch, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from autopar.models.shrink import build as build_arch
    _quiet()
    model = build_arch(arch, device, dropout=0.0)
    return model if dtype == torch.float32 else model.to(dtype)


def data(arch, model) -> list[dict[str, torch.Tensor]]:
    from autopar.models.shrink import example
    return [example(arch, model, GLOBAL_BATCH, seed=1 + i) for i in range(STEPS)]


def rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}


@functools.lru_cache(maxsize=8)
def reference(arch, micro_batch_size: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One process: step 1's loss and gradients, the parameters after STEPS AdamW steps, each step
    the mean of its micro-batches' losses. Built and run with one torch thread, as the ranks are
    (worlds.py): a model whose init runs LAPACK (RWKV's ``orthogonal_``) draws other weights at
    another thread count (1.7e-6 apart for RWKV, which its wkv recurrence grows past the tolerance
    in 3 steps), and the comparison is of programs, not of starting points."""
    from autopar.profiler.host import torch_threads
    with torch_threads(1):
        model = build(arch, dtype=dtype)
        batches = data(arch, model)

        def step_loss(batch) -> torch.Tensor:
            parts = [rows(batch, i, i + micro_batch_size) for i in range(0, GLOBAL_BATCH, micro_batch_size)]
            return sum(model(**p).loss for p in parts) / len(parts)

        return one_process(model, batches, step_loss)


def prepare(arch) -> tuple[dict[str, Cell], dict[str, dict]]:
    """The parent's half: the columns decided here (a model that does not build or compute a loss
    raises ShrinkError), and the plan of each configuration to run."""
    from autopar.capture import capture
    from autopar.config import Precision
    from autopar.models.shrink import ShrinkError, example
    from autopar.codegen.inputs import with_inputs
    from autopar.solver import solve
    from autopar.solver.sharding import ILPLimits
    from autopar.solver.sharding_solver import ShardingSolver
    model = build(arch)
    try:
        loss = model(**example(arch, model, 2)).loss
    except Exception as exc:
        raise ShrinkError(f"{arch.name} does not compute a loss at the test size: {cell_of(exc).detail}") from exc
    if loss is None or not torch.isfinite(loss):
        raise ShrinkError(f"{arch.name} gives no finite loss at the test size ({loss})")
    cells: dict[str, Cell] = {}
    plans: dict[str, dict] = {}
    cluster = test_cluster(2)
    try:
        meta = build(arch, "meta")
        one = example(arch, meta, 1, device="meta")
        graph = capture(meta, one)
        cells["capture"] = Cell("ok")
    except Exception as exc:
        cells["capture"] = cell_of(exc)
        return cells, plans
    # one ShardingSolver for the five solves (each layer signature's ILPs solved once), each ILP
    # capped at ILP_SECONDS: a plan of a 2-layer model that needs more is reported, not waited for
    precision = Precision.for_device(cluster.device.name)
    sharding = ShardingSolver(graph, cluster, precision, limits=ILPLimits(time=ILP_SECONDS))
    with _deadline(PLAN_SECONDS):
        try:
            plan, stats = solve(graph, cluster, GLOBAL_BATCH, ilp_time_limit=ILP_SECONDS, sharding=sharding)
            cells["plan"] = Cell("ok")
            if stats.ilp_stopped_early:
                cells["plan"] = Cell("failed", f"too slow: {stats.ilp_stopped_early} sharding ILP(s) stopped at the "
                                               f"{ILP_SECONDS:.0f} s cap on this 2-layer model")
        except _TooSlow:
            cells["plan"] = Cell("failed", f"too slow: planning this 2-layer model took over {PLAN_SECONDS:.0f} s")
            return cells, plans
        except Exception as exc:
            cells["plan"] = cell_of(exc)
        for name, pins in CONFIGS.items():
            try:
                plan, _ = solve(graph, cluster, GLOBAL_BATCH, fixed={**BASE, **pins}, ilp_time_limit=ILP_SECONDS,
                                sharding=sharding)
                plans[name] = with_inputs(plan, one).to_dict()
            except _TooSlow:
                cells[name] = Cell("failed", f"too slow: planning took over {PLAN_SECONDS:.0f} s")
                return cells, {}
            except Exception as exc:
                cells[name] = cell_of(exc)
    return cells, plans


class _TooSlow(BaseException):
    """Raised by the alarm of :func:`_deadline` (not an Exception: nothing on the way may catch it)."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise _TooSlow in this (main) thread after ``seconds``; a C call in progress (an ILP) ends first."""
    def ring(signum, frame):
        raise _TooSlow()
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_arch(rank: int, world: int, arch, plans: dict[str, dict],
             dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ranks' half: each planned configuration trained STEPS steps (worlds.py job)."""
    import autopar
    out: dict[str, Any] = {}
    for name, plan_dict in plans.items():
        try:
            model = build(arch, dtype=dtype)
            program = autopar.parallelize(model, autopar.Plan.from_dict(plan_dict), adamw, timeout=60)
            batches = data(arch, model)
            loss = program.forward_backward(batches[0])
            grads = program.full_grads()
            program.optimizer.step()
            for batch in batches[1:]:
                program.train_step(batch)
            out[name] = {"loss": loss.item(), "grads": grads,
                         "params": round_trip(program.full_state_dict(), build(arch, dtype=dtype))}
        except Exception as exc:
            out[name] = {"cell": cell_of(exc), "trace": traceback.format_exc(limit=-3)}
    return out


def judge(arch, plans: dict[str, dict], per_rank: list[dict[str, Any]],
          dtype: torch.dtype = torch.float32) -> dict[str, Cell]:
    """Each configuration's cell from every rank's result against one process."""
    cells = {}
    for name, plan_dict in plans.items():
        got = [r[name] for r in per_rank]
        bad = next((g["cell"] for g in got if "cell" in g), None)
        if bad is not None:
            cells[name] = bad
            continue
        ref = reference(arch, plan_dict["config"]["micro_batch_size"], dtype)
        try:
            for rank, g in enumerate(got):
                check_matches(g, ref, rank)
            cells[name] = Cell("ok")
        except AssertionError as exc:
            cells[name] = Cell("failed", f"{DIFFERS}: {str(exc)[:200]}")
    return cells


def pinned_plans(arch, names, dtype: torch.dtype = torch.float32) -> dict[str, dict]:
    """The plan of each configuration of ``names`` (keys of CONFIGS), made as prepare makes them: the
    model built on the meta device in ``dtype``, captured from a batch-1 example, and priced in ``dtype``."""
    from autopar.capture import capture
    from autopar.codegen.inputs import with_inputs
    from autopar.models.shrink import example
    from autopar.solver import solve
    from autopar.config import PRECISION_DTYPES, Precision
    meta = build(arch, "meta", dtype)
    one = example(arch, meta, 1, device="meta")
    graph = capture(meta, one)
    name_of = PRECISION_DTYPES[str(dtype).removeprefix("torch.")]   # priced in the dtype the programs run in
    precision = Precision(compute=name_of, grads=name_of)
    plans = {}
    for name in names:
        plan, _ = solve(graph, test_cluster(2), GLOBAL_BATCH, fixed={**BASE, **CONFIGS[name]}, precision=precision)
        plans[name] = with_inputs(plan, one).to_dict()
    return plans


def float64_look(arch, cells: dict[str, Cell]) -> None:
    """Each configuration that differs from one process in float32 run again in float64 (model,
    plan and reference) and judged there at the same tolerances, in place in ``cells``.

    3 AdamW steps at eps 1e-4 grow float32 rounding: a gradient entry near eps moves its update
    by a fraction of lr, and a model with large activations (CpmAnt's logits, loss 24) or an
    exponential recurrence (RWKV's wkv) turns that into gradients 10-100x further apart at each
    step. A program that computes the wrong thing differs in float64 as well; one that only
    rounds differently is equal there (CpmAnt at tp=2: 6.8e-4 apart in float32 after 3 steps,
    1.2e-6 in float64). Such a cell is ok with its float32 figure kept in the detail (docs/coverage.md
    lists them); a configuration that differs in float64 too stays a failure."""
    import worlds
    names = [n for n in CONFIGS if n in cells and cells[n].status == "failed" and cells[n].detail.startswith(DIFFERS)]
    if not names:
        return
    try:
        plans = pinned_plans(arch, names, torch.float64)
        again = judge(arch, plans, worlds.world(2).run("hf_sweep:run_arch", arch, plans, torch.float64),
                      torch.float64)
    except Exception as exc:   # a model that cannot run in float64: its float32 failure stands
        again = {n: cell_of(exc) for n in names}
    for n in names:
        before = cells[n].detail.removeprefix(f"{DIFFERS}: ")
        cells[n] = (Cell("ok", f"equal in float64; float32 after {STEPS} steps: {before}") if again[n].status == "ok"
                    else Cell("failed", f"{cells[n].detail}; in float64: {again[n].detail}"[:400]))


def sweep(archs, progress=None) -> dict[str, dict[str, Cell]]:
    """Every architecture's row (``COLUMNS`` -> Cell), or ``{"build": Cell}`` for one that does not
    build at the test size. The ranks train one architecture while this process prepares the next."""
    import worlds
    from autopar.models.shrink import ShrinkError
    rows_out: dict[str, dict[str, Cell]] = {}
    pending = None   # (arch, cells, plans, job)

    def collect(item) -> None:
        arch, cells, plans, job = item
        if job is not None:
            w, k = job
            if w.broken:   # an earlier architecture broke the world this job was queued on
                w = worlds.world(2)
                k = w.submit("hf_sweep:run_arch", arch, plans)
            try:
                cells.update(judge(arch, plans, w.result(k, timeout=JOB_TIMEOUT)))
            except RuntimeError as exc:   # a rank died or the job hung: the next use rebuilds the world
                cells.update({n: Cell("failed", f"ranks: {exc}") for n in plans})
            float64_look(arch, cells)
        rows_out[arch.name] = {c: cells.get(c, Cell("skipped")) for c in COLUMNS}
        if progress:
            progress(arch, rows_out[arch.name])

    for arch in archs:
        try:
            cells, plans = prepare(arch)
        except ShrinkError as exc:
            rows_out[arch.name] = {"build": Cell("refused", str(exc)[:300])}
            if progress:
                progress(arch, rows_out[arch.name])
            continue
        except Exception as exc:   # a raw exception out of autopar's own half (capture and plan are caught)
            rows_out[arch.name] = {c: Cell("skipped") for c in COLUMNS} | {"capture": cell_of(exc)}
            if progress:
                progress(arch, rows_out[arch.name])
            continue
        w = worlds.world(2) if plans else None
        job = (w, w.submit("hf_sweep:run_arch", arch, plans)) if plans else None
        if pending is not None:
            collect(pending)
        pending = (arch, cells, plans, job)
    if pending is not None:
        collect(pending)
    return rows_out
