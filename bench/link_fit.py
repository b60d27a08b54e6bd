"""Link fit: how well ``t = alpha + beta * S`` predicts this machine's collectives at sizes it did not see.

Measures all-reduce, all-gather, reduce-scatter, all-to-all and p2p on 2 gloo ranks of this CPU
(1 thread each) with ``autopar.profiler.link_timing.measure_links``, at 28 per-rank sizes log-spaced
from 4 KiB to 256 MiB (21 repeats; about 80 s), then:

- fits every collective on all sizes (least relative error, alpha, beta >= 0; a second segment
  when it pays, see the links module docstring) and prints alpha, 1/beta and the fit's error;
- fits again on every other size only and predicts the held-out sizes (``heldout_errors``);
- prints the ring model's per-step latency ``a`` and bandwidth ``B`` that ``to_link`` hands the
  cost model, and the DTensor dispatch overhead.

The range goes past 32 MiB on purpose: on this machine gloo's all-gather and reduce-scatter
slow down from there (each call allocates a buffer of the message's size, and glibc's malloc
maps allocations of 32 MiB and more afresh, so every call page-faults them in), and the
held-out check should cover both regimes. Target: every collective's held-out sizes within
15% (max relative error).

Noise: on a small VM a fraction of gloo calls waits for a scheduler tick (4 ms) in one of a
collective's thread hand-offs, so a size's median can move by tens of percent between runs
even on an idle machine. ``--compare`` with an earlier saved run prints that run-to-run
difference per collective: the floor under any held-out error. The bench also prints how much
CPU other processes used while it measured.

Run: .venv/bin/python bench/link_fit.py [--repeats 21] [--sizes 28] [--save profile.json] [--detail]
     .venv/bin/python bench/link_fit.py --load profile.json   (fit a saved profile again)
     .venv/bin/python bench/link_fit.py --compare earlier.json (also: how much two runs differ per size)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from autopar.profiler.link_timing import measure_links
from autopar.profiler.links import LinkProfile, fit_profile, heldout_errors, to_link

TARGET = 0.15


def _segments(fit) -> str:
    if not fit.piecewise:
        return "one line"
    return f"2 (<= {fit.small_max_bytes / 2**20:.3g} MiB, >= {fit.large_min_bytes / 2**20:.3g} MiB)"


def report(profile: LinkProfile, every: int = 2, detail: bool = False) -> bool:
    """Print the tables; True when every collective meets the target."""
    fits = fit_profile(profile)
    held = heldout_errors(profile, every=every)
    sizes = [b for b, _ in next(iter(profile.samples.values()))]
    print(f"\n{profile.backend} x{profile.nprocs} ranks, {profile.threads_per_rank} thread(s) each; "
          f"{len(sizes)} sizes {sizes[0] / 2**10:.0f} KiB .. {sizes[-1] / 2**20:.0f} MiB; "
          f"held out: every other size ({len(sizes) // every} sizes)\n")
    print("| collective | alpha (us) | 1/beta (GB/s) | segments | fit median / max rel. err. | outliers (>30%) | "
          "held-out median / max rel. err. | within 15% |")
    print("|---|---:|---:|---|---:|---:|---:|:---:|")
    for kind, fit in fits.items():
        h = held[kind]
        print(f"| {kind} | {fit.alpha * 1e6:.1f} | {1 / fit.beta / 1e9:.2f} | {_segments(fit)} | "
              f"{fit.median_rel_error:.1%} / {fit.max_rel_error:.1%} | {len(fit.outliers)} | "
              f"{h.median_rel_error:.1%} / {h.max_rel_error:.1%} | {'yes' if h.max_rel_error <= TARGET else 'NO'} |")
    link = to_link(fits, profile.nprocs)
    print(f"\nRing model handed to the cost model (to_link, n = {profile.nprocs}):\n")
    print("| collective | a: seconds per ring step (us) | B (GB/s) |")
    print("|---|---:|---:|")
    for kind, cf in link.collectives.items():
        print(f"| {kind} | {cf.latency * 1e6:.1f} | {cf.bandwidth / 1e9:.2f} |")
    print(f"\nDTensor dispatch overhead per op: forward {profile.dispatch_fwd_seconds * 1e6:.1f} us, "
          f"backward {profile.dispatch_bwd_seconds * 1e6:.1f} us")
    if detail:
        for kind, h in held.items():
            print(f"\n{kind} held-out sizes (fit on the others):\n")
            print("| bytes | measured (us) | predicted (us) | rel. err. |")
            print("|---:|---:|---:|---:|")
            for nbytes, measured, predicted in h.heldout:
                print(f"| {nbytes} | {measured * 1e6:.1f} | {predicted * 1e6:.1f} | "
                      f"{(predicted - measured) / measured:+.1%} |")
    failed = [k for k, h in held.items() if h.max_rel_error > TARGET]
    print(f"\nVerdict (target: held-out sizes within {TARGET:.0%}, max rel. error): "
          + ("PASS for every collective" if not failed else f"FAIL for {', '.join(failed)}"))
    return not failed


def repeatability(profile: LinkProfile, other: LinkProfile) -> None:
    """Print how much two measurements of the same sizes differ: the noise floor any fit meets."""
    print("\nRun-to-run repeatability (this profile vs --compare, same sizes): |t1 / t2 - 1|\n")
    print("| collective | median | max | sizes off by more than 15% |")
    print("|---|---:|---:|---:|")
    for kind, pairs in profile.samples.items():
        mine, theirs = dict(pairs), dict(other.samples.get(kind, ()))
        common = sorted(set(mine) & set(theirs))
        if not common:
            print(f"| {kind} | - | - | no common sizes |")
            continue
        diff = np.array([abs(mine[b] / theirs[b] - 1) for b in common])
        print(f"| {kind} | {np.median(diff):.1%} | {diff.max():.1%} | {(diff > TARGET).sum()} of {len(diff)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", type=int, default=28, help="number of log-spaced sizes")
    parser.add_argument("--min-bytes", type=int, default=4 * 2**10)
    parser.add_argument("--max-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--save", help="write the measured profile (a ProfileDB 'links' record) to this JSON file")
    parser.add_argument("--load", help="fit a profile saved with --save instead of measuring")
    parser.add_argument("--detail", action="store_true", help="also print every held-out size")
    parser.add_argument("--compare", help="a profile saved with --save: print the run-to-run differences")
    args = parser.parse_args()
    if args.load:
        with open(args.load) as fh:
            profile = LinkProfile.from_record(json.load(fh))
    else:
        sizes = [int(x) for x in np.geomspace(args.min_bytes, args.max_bytes, args.sizes)]
        profile = measure_links(args.nprocs, args.threads, sizes=sizes, repeats=args.repeats)
        print(profile.conditions.describe())    # other processes' load while it measured (autopar/conditions.py)
        if args.save:
            with open(args.save, "w") as fh:
                json.dump(profile.to_record(), fh, indent=1)
    ok = report(profile, detail=args.detail)
    if args.compare:
        with open(args.compare) as fh:
            repeatability(profile, LinkProfile.from_record(json.load(fh)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
