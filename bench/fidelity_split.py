"""Predicted vs published step times, calibration and validation apart (issue 50).

Every row of bench/data/published_runs.json is priced with the presets' constants as they are (nothing
fitted here): a row whose configuration is published in full (degrees, micro-batch, ZeRO stage,
recomputation, sequence parallelism, and the schedule when pp > 1) is an estimate (``price``, what
``autopar.estimate`` runs); a row that leaves fields out is planned with the published ones pinned
(``fixed=``), as bench/published.py does. Models are autopar's GPT / Llama built on the meta device,
one capture per shape; each row carries its stack's precision and kernels ("fused" for Megatron-LM,
Megatron-DeepSpeed and Megatron-Core, "eager" or "compiled" for torchtitan as its column ran).

The split is bench/data/split.json, fixed by source before any validation row was compared. Reported:
the error of each row's step time (predicted / measured - 1: positive means predicted slower),
median and p90 of |error| on calibration and on validation, per device family; for every validation
sweep (one model on one cluster at several configurations), Spearman's rank correlation between
predicted and measured time per sequence, and the regret of autopar's pick: how much slower the
configuration autopar ranks fastest measured than the fastest measured one.

What a sweep's own measurements allow its ranking (model-free): two rows of one configuration at two global
batches fix a 1F1B step's time per pipeline slot and its tail (the step beyond its m + pp - 1 slots); a pair whose
tail is above half its step no schedule explains, so one of its measurements did not run the configuration as
the others did. Each sweep's ceiling is the Spearman of a model exact on every row, such a pair's member priced
as its sibling implies (whichever member gives the higher ceiling), and the median of that model with 1%, 2% and 5%
independent errors: the ranking a faithful model can reach on the sweep, printed beside autopar's.

Targets (issue 50), on validation: median |error| <= 8%, p90 <= 15%; every sweep Spearman >= 0.9 and
regret <= 5%. Exits 1 on a miss (and on a row that cannot be priced). Reads nothing outside the repo.

The validation rows' signed errors are the residuals autopar's error bars read (autopar/plan/interval.py):
``--write-residuals`` writes them to autopar/plan/residuals.json; without it the run checks that file
against what it priced and exits 1 when they differ beyond float noise (the model changed: rewrite it).
Run: .venv/bin/python bench/fidelity_split.py [--json bench/results/fidelity_split.json] [--write-residuals]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import autopar
from autopar.config import ParallelConfig
from autopar.plan import interval
from autopar.presets import DEVICE_PRESETS
from autopar.solver import price
from published import CONSTANT_FAMILIES, Row, cluster_of, graph_of, load_rows, load_split, plan_row

MEDIAN, P90, SPEARMAN, REGRET = 0.08, 0.15, 0.9, 0.05
# The fields a configuration must publish to be priced as it ran (schedule only matters with pp > 1).
# A sweep's own consistency (model-free, measurements only). Two rows of one configuration at two global batches
# run m1 < m2 micro-batches through the same pipeline: under 1F1B a step is (m + pp - 1) slots of one micro-batch's
# stage time t plus a tail c (the data-parallel reduce, the optimizer step), so the pair fixes t and c. A pair whose
# tail comes out above half its step, or below -TAIL_SLACK of it, no schedule explains: one of its two measurements
# is not the configuration's (a slow node, another setting); which one the pair cannot say.
TAIL_MAX, TAIL_SLACK = 0.5, 0.02
CEILING_ERRORS = (0.01, 0.02, 0.05)   # independent model errors the ranking ceiling is also quoted at (median of draws)
CEILING_DRAWS, CEILING_SEED = 2000, 0
PINNED = ("dp", "tp", "pp", "cp", "micro_batch_size", "zero", "recompute", "sequence_parallel")
RESIDUAL_NOISE = 1e-4   # |change| of a row's error taken as noise (0.01 points; intervals print 3 digits)


@dataclass(frozen=True)
class Priced:
    row: Row
    split: str
    measured: float          # s per step, from the published figure
    predicted: float         # s per step, nan when the row could not be priced
    how: str                 # "estimate" | "planned" | the error that stopped it
    config: str

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def fully_pinned(row: Row) -> bool:
    fields = PINNED + (("schedule",) if row.fixed.get("pp", 1) > 1 else ())
    return all(f in row.fixed for f in fields)


def price_row(row: Row, split: str) -> Priced:
    cluster = cluster_of(row)
    measured = row.step_time_of(row.published, cluster)
    try:
        if fully_pinned(row):
            plan = price(graph_of(row.model), cluster, ParallelConfig(**row.fixed), row.global_batch,
                         precision=row.precision)
            how = "estimate" if plan.fits else "estimate (does not fit)"
        else:
            plan, how = plan_row(row), "planned"
    except autopar.AutoparError as exc:
        return Priced(row, split, measured, math.nan, f"{type(exc).__name__}: {exc}", "")
    return Priced(row, split, measured, plan.step_time, how, plan.config.short())


def p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else math.nan


def ranks(values: list[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    order = np.argsort(values, kind="stable")
    out = np.empty(len(values))
    out[order] = np.arange(1, len(values) + 1)
    for v in set(values):
        tied = [i for i, x in enumerate(values) if x == v]
        out[tied] = np.mean(out[tied])
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    if np.std(ra) == 0 or np.std(rb) == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def slots(row: Row) -> int:
    """Pipeline slots of a 1F1B step: micro-batches per data-parallel rank plus the fill (pp - 1)."""
    f = row.fixed
    return row.global_batch // (f["dp"] * f["micro_batch_size"]) + f.get("pp", 1) - 1


def inconsistent_pairs(rows: list[Priced]) -> list[tuple[Priced, Priced, float]]:
    """Pairs of one configuration at two global batches that no 1F1B step explains (``TAIL_MAX``), each with the
    tail (s) the pair implies."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if (a.row.model, dict(a.row.fixed)) != (b.row.model, dict(b.row.fixed)) or slots(a.row) == slots(b.row):
                continue
            if a.row.fixed.get("schedule", "1f1b") != "1f1b":
                continue
            lo, hi = sorted((a, b), key=lambda p: slots(p.row))
            t = (hi.measured - lo.measured) / (slots(hi.row) - slots(lo.row))
            tail = hi.measured - slots(hi.row) * t
            if t <= 0 or not -TAIL_SLACK * hi.measured <= tail <= TAIL_MAX * hi.measured:
                out.append((lo, hi, tail))
    return out


def ranking_ceiling(rows: list[Priced]) -> tuple[float, tuple[float, ...], list[tuple[Priced, Priced, float]]]:
    """The Spearman a model exact on every row of the sweep reaches, when an inconsistent pair's member is priced at
    what its sibling implies (t from the sibling, no tail); the best over which member of each pair is taken as the
    measurement that ran the configuration (the reading kindest to the target). Also the median over draws of that
    model with independent errors of each of ``CEILING_ERRORS``; and the inconsistent pairs."""
    pairs = inconsistent_pairs(rows)
    meas = [p.measured / p.row.global_batch for p in rows]
    index = {id(p): i for i, p in enumerate(rows)}
    best, best_values = -math.inf, None
    for choice in range(2 ** len(pairs)):
        values = [p.measured for p in rows]
        for bit, (lo, hi, _) in enumerate(pairs):
            wrong, kept = (lo, hi) if choice >> bit & 1 else (hi, lo)
            values[index[id(wrong)]] = kept.measured * slots(wrong.row) / slots(kept.row)
        rho = spearman([v / p.row.global_batch for v, p in zip(values, rows)], meas)
        if rho > best:
            best, best_values = rho, values
    rng = np.random.default_rng(CEILING_SEED)
    noisy = []
    for sigma in CEILING_ERRORS:
        draws = [spearman([v * (1 + sigma * e) / p.row.global_batch
                           for v, p, e in zip(best_values, rows, rng.standard_normal(len(rows)))], meas)
                 for _ in range(CEILING_DRAWS)]
        noisy.append(float(np.median(draws)))
    return best, tuple(noisy), pairs


def summary(label: str, rows: list[Priced]) -> tuple[float, float]:
    errs = [abs(r.error) for r in rows if not math.isnan(r.predicted)]
    signed = [r.error for r in rows if not math.isnan(r.predicted)]
    failed = len(rows) - len(errs)
    if not errs:
        print(f"  {label:<34} {len(rows):>3} rows, none priced")
        return math.nan, math.nan
    med, q90 = statistics.median(errs), p90(errs)
    print(f"  {label:<34} {len(rows):>3} rows  median |err| {med * 100:5.1f}%  p90 {q90 * 100:5.1f}%  "
          f"max {max(errs) * 100:5.1f}%  mean signed {statistics.mean(signed) * 100:+5.1f}%"
          + (f"  ({failed} not priced)" if failed else ""))
    return med, q90


def residuals_document(priced: list[Priced]) -> dict:
    """autopar/plan/residuals.json's content: every priced validation row's signed error, and every GPU
    preset's family (the CPU preset holds placeholder constants no published run validates)."""
    rows = [dict(id=p.row.name, source=p.row.source, device=cluster_of(p.row).device.name, family=p.row.family,
                 sweep=p.row.sweep, error=p.error)
            for p in priced if p.split == "validation" and not math.isnan(p.predicted)]
    families = {name: CONSTANT_FAMILIES.get(name, name.split("-")[0]) for name in DEVICE_PRESETS if name != "cpu"}
    return dict(
        schema=interval.RESIDUALS_SCHEMA,
        description="Signed error predicted / measured - 1 of every validation row of bench/data/published_runs.json "
                    "(split by source in bench/data/split.json, no constant fitted on them), each priced with the "
                    "presets' constants as autopar.estimate prices a fully published configuration, or planned "
                    "with the published fields pinned; written by `bench/fidelity_split.py --write-residuals`. "
                    "`families` maps each GPU preset to the device family whose rows give its interval.",
        families=families, rows=rows)


def check_residuals(document: dict, write: bool) -> bool:
    """Write the residuals (``write``), or check the shipped file holds what was just priced."""
    path = interval.RESIDUALS_PATH
    if write:
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {len(document['rows'])} validation residuals to {path}")
        return True
    try:
        shipped = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"\nresiduals: cannot read {path} ({exc}); rerun with --write-residuals")
        return False
    same = (shipped.get("families") == document["families"]
            and [{k: v for k, v in r.items() if k != "error"} for r in shipped.get("rows", [])]
            == [{k: v for k, v in r.items() if k != "error"} for r in document["rows"]]
            and all(abs(a["error"] - b["error"]) <= RESIDUAL_NOISE
                    for a, b in zip(shipped["rows"], document["rows"])))
    print(f"\nresiduals: {path} {'matches' if same else 'DIFFERS FROM'} this run's validation errors"
          + ("" if same else ": the cost model's predictions changed; rerun with --write-residuals and commit it"))
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row's figures here")
    parser.add_argument("--write-residuals", action="store_true",
                        help="write the validation rows' errors to autopar/plan/residuals.json (the error bars)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    split = load_split()
    priced = []
    for row in load_rows():
        t = time.perf_counter()
        priced.append(price_row(row, split[row.source]))
        print(f"  priced {row.name:<56} {time.perf_counter() - t:5.1f} s", file=sys.stderr)

    print(f"{'row':<56} {'split':<5} {'family':<9} {'measured s':>10} {'predicted s':>11} {'error':>7}  how / plan")
    for p in priced:
        pred = f"{p.predicted:>11.3f}" if not math.isnan(p.predicted) else f"{'-':>11}"
        err = f"{p.error * 100:>+6.1f}%" if not math.isnan(p.predicted) else f"{'-':>7}"
        print(f"{p.row.name:<56} {p.split[:5]:<5} {p.row.family:<9} {p.measured:>10.3f} {pred} {err}  "
              f"{p.how}: {p.config}")

    print("\nStep-time error, |predicted / measured - 1| (constants as the presets hold them, nothing fitted here)")
    results = {}
    for name in ("calibration", "validation"):
        mine = [p for p in priced if p.split == name]
        results[name] = summary(name, mine)
        for family in sorted({p.row.family for p in mine}):
            summary(f"  {name} {family}", [p for p in mine if p.row.family == family])

    # where the residual bias sits: by the stack that ran a row and its tensor-parallel degree (a term of the step
    # that grows with tp and that one stack pays and another does not shows here before it shows in the totals)
    print("\nSigned error by stack and tensor-parallel degree (a diagnosis, not a target)")
    for name in ("calibration", "validation"):
        groups: dict[tuple[str, int], list[float]] = {}
        for p in priced:
            if p.split == name and not math.isnan(p.predicted):
                groups.setdefault((p.row.stack, p.row.fixed.get("tp", 0)), []).append(p.error)
        for (stack, tp), errs in sorted(groups.items()):
            print(f"  {name:<12} {stack[:34]:<34} tp={tp or '?':<3} {len(errs):>3} rows  mean {statistics.mean(errs) * 100:+6.1f}%"
                  f"  median {statistics.median(errs) * 100:+6.1f}%")

    print("\nValidation sweeps: ranking by time per sequence (step / global batch)")
    print(f"  {'sweep':<24} {'rows':>4} {'Spearman':>9} {'regret':>7}  pick (predicted fastest) | fastest measured")
    sweeps_ok, sweep_rows, ceilings = True, [], []
    for sweep in sorted({p.row.sweep for p in priced if p.row.sweep and p.split == "validation"}):
        mine = [p for p in priced if p.row.sweep == sweep and not math.isnan(p.predicted)]
        if len(mine) < len([p for p in priced if p.row.sweep == sweep]):
            sweeps_ok = False
        pred = [p.predicted / p.row.global_batch for p in mine]
        meas = [p.measured / p.row.global_batch for p in mine]
        rho = spearman(pred, meas)
        pick, best = mine[int(np.argmin(pred))], mine[int(np.argmin(meas))]
        regret = (pick.measured / pick.row.global_batch) / min(meas) - 1
        sweeps_ok &= not math.isnan(rho) and rho >= SPEARMAN and regret <= REGRET
        ceiling, noisy, pairs = ranking_ceiling(mine)
        sweep_rows.append(dict(sweep=sweep, rows=len(mine), spearman=rho, regret=regret,
                               pick=pick.row.name, fastest=best.row.name, ceiling=ceiling,
                               ceiling_with_error={f"{s:g}": v for s, v in zip(CEILING_ERRORS, noisy)},
                               inconsistent=[[lo.row.name, hi.row.name, tail] for lo, hi, tail in pairs]))
        print(f"  {sweep:<24} {len(mine):>4} {rho:>9.2f} {regret * 100:>6.1f}%  {pick.row.name} | {best.row.name}")
        ceilings.append((sweep, ceiling, noisy, pairs))
    print(f"\nWhat the sweeps' own measurements allow: pairs of one configuration at two global batches whose 1F1B "
          f"tail\n(step - (m + pp - 1) slots) is above {TAIL_MAX:.0%} of the step, and the Spearman of a model exact "
          f"on every row\n(such a pair's member priced as its sibling implies), and of that model with independent "
          f"errors ({', '.join(f'{s:.0%}' for s in CEILING_ERRORS)}; median of {CEILING_DRAWS} draws)")
    for sweep, ceiling, noisy, pairs in ceilings:
        print(f"  {sweep:<24} ceiling {ceiling:5.2f}; with error " + " / ".join(f"{v:.2f}" for v in noisy))
        for lo, hi, tail in pairs:
            print(f"    inconsistent: {lo.row.name} ({lo.measured:.2f} s, {slots(lo.row)} slots) and {hi.row.name} "
                  f"({hi.measured:.2f} s, {slots(hi.row)} slots): a tail of {tail:.1f} s")

    med, q90 = results["validation"]
    priced_all = all(not math.isnan(p.predicted) for p in priced)
    residuals_ok = check_residuals(residuals_document(priced), args.write_residuals)
    ok = priced_all and med <= MEDIAN and q90 <= P90 and sweeps_ok and residuals_ok
    print(f"\nvalidation: median {med * 100:.1f}% (target <= {MEDIAN * 100:.0f}%), p90 {q90 * 100:.1f}% "
          f"(<= {P90 * 100:.0f}%); sweeps: Spearman >= {SPEARMAN} and regret <= {REGRET * 100:.0f}% on every one: "
          f"{sweeps_ok}; every row priced: {priced_all}; residuals current: {residuals_ok}")
    print(f"{time.perf_counter() - t0:.0f} s; targets met: {ok}")
    if args.json:
        args.json.write_text(json.dumps(dict(
            rows=[dict(id=p.row.name, split=p.split, family=p.row.family, sweep=p.row.sweep, measured_s=p.measured,
                       predicted_s=None if math.isnan(p.predicted) else p.predicted, how=p.how, plan=p.config)
                  for p in priced],
            sweeps=sweep_rows), indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
