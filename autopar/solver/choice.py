r"""Which plan the search returns among near-ties, and the runners-up it shows.

Cost-model step times carry a few percent of error (BENCHMARKS.md), so a plan 0.5% faster
under the model is not faster in any sense a user can rely on, while each moving part of a plan
(a ZeRO stage, another parallel dimension, interleaving, sequence parallelism, recomputation) is
code that can fail, memory traffic the model prices only approximately, and a flag to carry into
another stack. The rule, with ``F`` the fastest step time that fits and ``tol`` the tie
tolerance (``plan(..., tie_tolerance=0.01)``)::

    band   = {plans p : T(p) <= F (1 + tol)}
    choice = argmin over band of (moving_parts(p), T(p), peak memory(p), plainer config)

``moving_parts`` (below) is a tuple ordered lexicographically: first the number of parts in use,
then the ZeRO stage, the parallel dimensions besides data parallelism, interleaving, sequence
parallelism and recomputation. ``tol = 0`` returns the fastest plan (exact ties, step times within
``TIE`` of each other, still go to the simpler one). The search (search.py) finds the choice
exactly: after the fastest plan it evaluates every candidate whose step-time bound lies in the
band and whose parts (recomputation not counted: a lower bound) could beat the choice so far.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import replace
from typing import Any, Iterable, Mapping

from ..config import OFFLOADS, ParallelConfig
from ..cost_model.coverage import zero3_scaling_note
from ..plan import Alternative, Plan
from .space import Candidate

TOP_ALTERNATIVES = 5
TIE = 1e-9   # relative: step times closer than this are equal (a communication-bound step sums the same
             # collectives in another order when the mesh is refolded, e.g. dp=64 vs dp=32 x cp=2)

Seen = list[tuple[float, Candidate, "Plan | float"]]


def check_tolerance(tie_tolerance: Any) -> float:
    from ..errors import ConfigError
    if (isinstance(tie_tolerance, bool) or not isinstance(tie_tolerance, (int, float))
            or not 0 <= tie_tolerance < 1):
        raise ConfigError(f"tie_tolerance={tie_tolerance!r} must be a fraction in [0, 1) (0.01: plans within 1% of "
                          "the fastest are ties and the simplest of them is chosen; 0: the fastest)")
    return float(tie_tolerance)


def moving_parts(cfg: ParallelConfig) -> tuple:
    """Fewer is simpler: (parts in use, ZeRO stage, parallel dimensions besides dp, a schedule other than
    1F1B (interleaved, zero-bubble), sequence parallel, recomputes)."""
    dims = sum(d > 1 for d in (cfg.tp, cfg.pp, cfg.cp, cfg.ep))
    interleaved = cfg.schedule not in ("1f1b", "gpipe")
    recomputes = cfg.recompute != "none" or any(m != "none" for m in cfg.stage_recompute)
    offload = OFFLOADS.index(cfg.offload)   # none, optimizer, all: more moves to the host
    parts = (cfg.zero > 0) + dims + interleaved + cfg.sequence_parallel + recomputes + (offload > 0)
    return (parts, cfg.zero + offload, dims, interleaved, cfg.sequence_parallel, recomputes)


def least_parts(c: Candidate) -> tuple:
    """A lower bound of ``moving_parts`` over the plans of candidate ``c`` (its recompute modes are
    chosen by the stage DP; none counted here)."""
    return moving_parts(c.config())


def within(step_time: float, fastest: float, tolerance: float) -> bool:
    return step_time <= fastest * (1 + tolerance) * (1 + TIE)


def _compare(a: Plan, b: Plan) -> int:
    """The choice's order among plans of the band: parts, then time (equal within TIE), memory, config."""
    ka, kb = moving_parts(a.config), moving_parts(b.config)
    if ka != kb:
        return -1 if ka < kb else 1
    if not math.isclose(a.step_time, b.step_time, rel_tol=TIE):
        return -1 if a.step_time < b.step_time else 1
    ra, rb = (a.peak_memory, _cfg_key(a.config)), (b.peak_memory, _cfg_key(b.config))
    return (ra > rb) - (ra < rb)


def choose(plans: Iterable[Plan], tolerance: float, fastest: float | None = None) -> Plan | None:
    """The module docstring's choice among ``plans`` (None when there are none), with the band measured
    from ``fastest`` when given (the fastest of a larger set these are part of), else from theirs."""
    plans = list(plans)
    if not plans:
        return None
    if fastest is None:
        fastest = min(p.step_time for p in plans)
    band = [p for p in plans if within(p.step_time, fastest, tolerance)]
    return min(band, key=functools.cmp_to_key(_compare))


def could_beat(c: Candidate, bound: float, choice: Plan) -> bool:
    """Whether a plan of ``c`` (step time at least ``bound``) could come before ``choice``."""
    mine, theirs = least_parts(c), moving_parts(choice.config)
    return mine < theirs or (mine == theirs and bound < choice.step_time * (1 + TIE))


def _cfg_key(cfg: ParallelConfig) -> tuple:
    """Exact ties go to the plainer config: no context or expert parallelism first, then smaller degrees."""
    return (cfg.cp, cfg.ep, cfg.dp, cfg.tp, cfg.pp, cfg.micro_batch_size, cfg.schedule, cfg.virtual_stages,
            cfg.zero, cfg.recompute, cfg.sequence_parallel, cfg.stage_recompute)


def _order(p: Plan) -> tuple:
    return (p.step_time, p.peak_memory, _cfg_key(p.config))


def percent(fraction: float) -> str:
    """A relative difference without rounding a real one to "0.0%"."""
    x = 100 * abs(fraction)
    return f"{x:.1f}%" if x >= 0.1 else f"{x:.2g}%"


def alternatives(best: Plan, seen: Seen, memory: float, tolerance: float) -> tuple[Alternative, ...]:
    """The next-best evaluated configurations and why each lost to ``best``: the fastest few (a faster
    one or a near-tie says so), the best without context / expert parallelism when ``best`` uses it,
    the best plan without ZeRO-3 when ``best`` runs it, and the best plain data-parallel plan (zero=0) when
    ``best`` shards and one fits."""
    plans = [r for _, _, r in seen if isinstance(r, Plan) and r is not best]
    fastest = min([best.step_time] + [p.step_time for p in plans])
    # an offloading candidate whose states overflow the host's memory needs no more device memory (its need is
    # infinite, search.evaluate): no number of bytes per device says why it lost
    faster_unfit = sorted(((lb, c, r) for lb, c, r in seen if not isinstance(r, Plan) and math.isfinite(r)),
                          key=lambda e: (e[0], e[1].sort_key()))
    out = []
    distinct: dict[ParallelConfig, Plan] = {}
    for pl in sorted(plans, key=_order):
        if pl.config != best.config:
            distinct.setdefault(pl.config, pl)  # the same config with another layout is not an alternative

    def runner_up(pl: Plan, why: str = "") -> Alternative:
        return Alternative(config=pl.config, step_time=pl.step_time, peak_memory=pl.peak_memory, fits=True,
                           reason=_reason(pl, best, fastest, tolerance) + why, breakdown=pl.breakdown)

    for pl in heapq.nsmallest(TOP_ALTERNATIVES, distinct.values(), key=_order):
        out.append(runner_up(pl))
    for lb, c, need in faster_unfit[:3]:
        if lb >= best.step_time:
            break
        out.append(Alternative(config=c.config(), step_time=lb, peak_memory=need, fits=False,
                               reason=f"does not fit: needs {(need - memory) / 1e9:.1f} GB more per device "
                                      f"(at least {need / 1e9:.1f} GB; step time bound {lb:.3g} s)"))
    shown = {a.config for a in out}
    counterfactuals = [(lambda cfg, d=degree: getattr(cfg, d) == 1, f" (the best without {label} parallelism)")
                       for degree, label in (("cp", "context"), ("ep", "expert")) if getattr(best.config, degree) > 1]
    if best.config.zero == 3:   # what ZeRO-3 was weighed against (cost_model/coverage.py's note reads it)
        counterfactuals.append((lambda cfg: cfg.zero < 3, " (the best without ZeRO-3)"))
    if best.config.zero or best.config.offload != "none":
        counterfactuals.append((lambda cfg: cfg.zero == 0 and cfg.offload == "none",
                                " (the best without ZeRO: plain data parallelism)"))
    if best.config.offload != "none":
        counterfactuals.append((lambda cfg: cfg.offload == "none", " (the best without offload)"))
    for keep, why in counterfactuals:
        without = [pl for pl in distinct.values() if keep(pl.config)]
        if without:   # the counterfactual plan.explain() cites, when the search evaluated one
            pl = min(without, key=_order)
            if pl.config not in shown:
                out.append(runner_up(pl, why))
                shown.add(pl.config)
    return tuple(out)


def _reason(pl: Plan, best: Plan, fastest: float, tolerance: float) -> str:
    d = pl.step_time / best.step_time - 1
    if math.isclose(pl.step_time, best.step_time, rel_tol=TIE):
        return "as fast (a tie goes to fewer moving parts, then less memory)"
    if d < 0:
        return (f"faster by {percent(d)}, a tie within the {percent(tolerance)} tie tolerance: the chosen plan has "
                "fewer moving parts")
    if within(pl.step_time, fastest, tolerance):
        return f"slower by {percent(d)}, a tie within the {percent(tolerance)} tie tolerance"
    return f"slower by {percent(d)}"


def with_search_results(best: Plan, stats: Any, alts: tuple[Alternative, ...],
                        sharding: tuple[Mapping[str, Any], ...], variant: str, seen: Seen,
                        tolerance: float) -> Plan:
    """The best plan with what the search did: optimal (and the gap when it stopped early), notes,
    alternatives, the per-op sharding and the search's counts."""
    optimal = not stats.timed_out and not stats.ilp_stopped_early
    # the bounds behind the gap hold for the layouts the search had: only when every one is an
    # ILP optimum is the gap a bound over all plans
    gap = stats.gap if stats.timed_out and not stats.ilp_stopped_early else None
    notes = best.notes
    faster = min((r for _, _, r in seen if isinstance(r, Plan)), key=_order, default=best)
    if not math.isclose(faster.step_time, best.step_time, rel_tol=TIE) and faster.step_time < best.step_time:
        notes += (f"{faster.config.short()} is {percent(faster.step_time / best.step_time - 1)} faster under the cost "
                  f"model, within the {percent(tolerance)} tie tolerance: this plan has fewer moving parts "
                  "(tie_tolerance=0 picks the fastest)",)
    if stats.timed_out:
        gap_note = "" if gap is None else f" (no plan is more than {100 * gap:.1f}% faster under the cost model)"
        notes += ("the search stopped at time_limit: this is the best plan found so far and may not be "
                  f"optimal{gap_note}",)
    if stats.ilp_stopped_early:
        notes += (f"{stats.ilp_stopped_early} sharding ILP(s) stopped at their time or node limit or were sharded "
                  "greedily: those layouts are the best found, not proven optimal",)
    notes += tuple(f"sharding ILP fallback: {line}" for line in stats.ilp_fallbacks)
    beyond = zero3_scaling_note(replace(best, alternatives=alts))
    if beyond is not None:
        notes += (beyond,)
    extra = dict(best.extra)
    extra["layout"] = variant
    extra["search"] = {**stats.counts(), "tie_tolerance": tolerance, "fastest_step_time": faster.step_time}
    return replace(best, optimal=optimal, gap=gap, notes=notes,
                   alternatives=alts, sharding=sharding, extra=extra)
