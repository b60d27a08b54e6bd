"""``autopar profile``: measure this machine (or load the cached measurement) as ``Cluster.local``
does, and print the conditions each measurement was taken under (its age, other processes' load,
the spread of its repeats), the device, its fitted constants and the link fit of every collective.
``--refresh`` measures again and replaces the cache; ``--strict`` refuses a noisy measurement."""

from __future__ import annotations

import argparse
import json
import warnings

from ..cluster import Cluster
from ..errors import NoisyProfileWarning


def run(args: argparse.Namespace) -> int:
    from ..profiler.local import local_profile

    with warnings.catch_warnings():     # the noise is printed below, with the conditions
        warnings.simplefilter("ignore", NoisyProfileWarning)
        result = local_profile(args.nprocs, args.threads_per_rank, profile_db=args.db, refresh=args.refresh,
                               strict=args.strict, progress=not args.json)
    cluster, report = Cluster.of_local(result), result.device_fit
    if args.json:
        out = {"cluster": cluster.to_dict(), "profile_db": result.db_path,
               "conditions": [c.to_dict() | {"age_seconds": c.age_seconds(), "noise": list(c.noise())}
                              for c in cluster.profile_conditions],
               "device_fit": {"median_relative_error": report.median_relative_error,
                              "max_relative_error": report.max_relative_error, "samples": report.samples},
               "overlap": cluster.intra_node.overlap, "context_latency_seconds": cluster.intra_node.context_latency,
               "link_fits": {kind: {"alpha_seconds": fit.alpha, "beta_seconds_per_byte": fit.beta,
                                    "breakpoint_bytes": fit.breakpoint_bytes if fit.piecewise else None,
                                    "median_relative_error": fit.median_rel_error,
                                    "max_relative_error": fit.max_rel_error}
                             for kind, fit in result.link_fits.items()}}
        print(json.dumps(out, indent=1))
        return 0
    device = cluster.device
    print(cluster.describe())
    print(f"profile cache: {result.db_path}")
    for conditions in cluster.profile_conditions:
        print(f"  {conditions.describe()}")
    if cluster.profile_warning:
        print(f"warning: {cluster.profile_warning}")
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in device.peak_flops.items())
    print(f"device: {device.name}; peak GFLOP/s {peaks}; matmul efficiency {device.matmul_efficiency:.2f}, "
          f"half dim {device.matmul_half_dim:.1f}; memory bandwidth {device.memory_bandwidth / 1e9:.1f} GB/s; "
          f"kernel overhead {device.kernel_overhead * 1e6:.2f} us; tensor-parallel dispatch {device.dispatch_overhead * 1e6:.1f} us"
          f" fwd / {device.dispatch_overhead_backward * 1e6:.1f} us bwd"
          f"/op; DTensor optimizer step {device.dtensor_step_overhead * 1e6:.0f} us/tensor; memory {device.memory / 1e9:.1f} GB")
    print(f"  matmul fit over {report.samples} samples: median error {report.median_relative_error * 100:.1f}%, "
          f"max {report.max_relative_error * 100:.1f}%")
    if result.link_fits:
        link = cluster.intra_node
        print(f"links: compute hides {link.overlap * 100:.0f}% of a collective; a collective issued between compute "
              f"costs {link.context_latency * 1e3:.2f} ms more ({link.context_latency_p2p * 1e3:.2f} ms for p2p)")
        print(f"{'collective':<15} {'alpha us':>9} {'1/beta GB/s':>12} {'fit median':>11} {'fit max':>8}")
        for kind, fit in result.link_fits.items():
            bandwidth = 1 / fit.beta / 1e9 if fit.beta > 0 else float("inf")
            print(f"{kind:<15} {fit.alpha * 1e6:>9.1f} {bandwidth:>12.2f} {fit.median_rel_error * 100:>10.1f}% "
                  f"{fit.max_rel_error * 100:>7.1f}%")
    else:
        print("links: one rank, nothing to measure (the preset links stand in)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="measure this machine's device and links (Cluster.local)",
                          description=__doc__)
    prof.add_argument("--nprocs", type=int, default=None, help="ranks (default: every GPU, or every CPU core)")
    prof.add_argument("--threads-per-rank", type=int, default=None, help="torch threads per CPU rank")
    prof.add_argument("--db", default=None, help="profile cache (default ~/.cache/autopar/profile.json)")
    prof.add_argument("--refresh", action="store_true",
                      help="measure again and replace the cached profile (on an idle machine)")
    prof.add_argument("--strict", action="store_true",
                      help="refuse a measurement taken under other processes' load (exit 2) instead of warning")
    prof.add_argument("--json", action="store_true", help="print JSON")
    prof.set_defaults(run=run)
