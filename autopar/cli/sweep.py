"""``autopar sweep``: plan MODEL on several cluster sizes (autopar.sweep) and print one row per size: the plan,
step time, tokens/s, MFU, memory per device, time to train N tokens and its cost."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

from ..config import DEFAULT_TIE_TOLERANCE
from ..errors import ConfigError

SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def count(text: str) -> float:
    """"1e12", "15T", "4M", "2.5B" -> a positive number (k, M, B or G, T: thousands to trillions)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text, re.I)
    try:
        value = float(match.group(1)) * SUFFIXES[match.group(2).lower()] if match else float("nan")
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number (e.g. 1e12, 15T, 4M)")
    return value


def node_counts(text: str) -> list[int]:
    """"1,2,4,8,16" -> [1, 2, 4, 8, 16]."""
    try:
        out = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be node counts separated by commas, e.g. 1,2,4,8,16")
    return out


def run(args: argparse.Namespace) -> int:
    import autopar
    from ..cluster import Cluster
    from ..config import Precision, is_cpu_device
    from .models import load_model, parse_fields

    memory = None if args.device_memory is None else args.device_memory * 1e9
    node = Cluster.from_spec(f"1x{args.devices_per_node}x{args.device}", device_memory=memory)
    dtype = args.dtype or ("fp32" if is_cpu_device(node.device.name) else "bf16")
    loaded = load_model(args.model, seq_len=args.seq_len, dtype=dtype, device="meta")
    precision = dataclasses.replace(Precision.for_device(node.device.name), kernels=args.kernels)
    batch_tokens = None
    if args.global_batch_tokens is not None:
        batch_tokens = int(args.global_batch_tokens)
        if batch_tokens != args.global_batch_tokens:
            raise ConfigError(f"--global-batch-tokens {args.global_batch_tokens:g} must be a whole number of tokens")
    limits = {} if args.ilp_node_limit is None else {"ilp_node_limit": args.ilp_node_limit or None}
    result = autopar.sweep(loaded.model, node, loaded.inputs, nodes=args.nodes, global_batch_size=args.global_batch,
                           global_batch_tokens=batch_tokens, tokens=args.tokens,
                           price_per_gpu_hour=args.price_per_gpu_hour, name=loaded.name,
                           fixed=parse_fields(args.fixed, "--fixed") if args.fixed else None, precision=precision,
                           time_limit=args.time_limit, tie_tolerance=args.tie_tolerance, workers=args.workers,
                           verbose=not args.quiet, **limits)
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    written = []
    if args.csv:
        result.to_csv(args.csv)
        written.append(f"table written to {args.csv}")
    if args.plot:
        result.plot(args.plot)
        written.append(f"chart written to {args.plot}")
    if args.save_plans:
        written.append(_save_plans(result, loaded, args.save_plans))
    if not args.json:
        for line in written:
            print(line)
    return 0


def _save_plans(result, loaded, folder: str) -> str:
    """Each size's plan as FOLDER/NODESxPERxDEVICE.json, named and buildable as `autopar plan -o` saves it."""
    os.makedirs(folder, exist_ok=True)
    names = []
    for row in result.rows:
        if row.plan is None:
            continue
        plan = dataclasses.replace(row.plan, model_name=loaded.name,
                                   extra={**row.plan.extra, "model": dict(loaded.source)})
        name = f"{row.nodes}x{result.devices_per_node}x{result.device}.json"
        plan.save(os.path.join(folder, name))
        names.append(name)
    return f"plans written to {folder}: {', '.join(names) or 'none (no size has a plan)'}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="plan a model on several cluster sizes: throughput, MFU, time and cost",
                       description=__doc__ + " Example: autopar sweep llama3-70b --nodes 1,2,4,8,16 --device "
                       "H100-SXM --global-batch 1024 --tokens 15T --price-per-gpu-hour 2.5 --plot sweep.png")
    p.add_argument("model", metavar="MODEL",
                   help="a built-in name (`autopar models`) or package.module:factory returning (model, inputs)")
    p.add_argument("--nodes", required=True, type=node_counts, metavar="N,N,..",
                   help="the cluster sizes in nodes, e.g. 1,2,4,8,16")
    p.add_argument("--device", required=True, metavar="PRESET", help="the device preset, e.g. H100-SXM, A100-80GB")
    p.add_argument("--devices-per-node", type=int, default=8, metavar="N", help="devices per node (default 8)")
    batch = p.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch", type=int, default=None, metavar="N",
                       help="samples (sequences) per optimizer step, the same on every size")
    batch.add_argument("--global-batch-tokens", type=count, default=None, metavar="T",
                       help="tokens per optimizer step instead (a multiple of the sequence length), e.g. 4M")
    p.add_argument("--tokens", type=count, default=None, metavar="N",
                   help="training tokens, for the time to train (e.g. 1e12 or 15T)")
    p.add_argument("--price-per-gpu-hour", type=count, default=None, metavar="USD",
                   help="price of one device for one hour, for the cost (needs --tokens)")
    p.add_argument("--device-memory", type=float, default=None, metavar="GB",
                   help="memory per device in GB, replacing the preset's (e.g. to keep a reserve)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length of a built-in transformer")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="model dtype (default bf16 on accelerators, fp32 on CPUs)")
    p.add_argument("--kernels", default="eager", choices=("eager", "fused", "compiled"),
                   help="the kernels to price, as for `autopar plan` (default eager)")
    p.add_argument("--fixed", default=None, metavar="FIELD=V,..", help="pin ParallelConfig fields on every size")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="stop each size's search after S s")
    p.add_argument("--ilp-node-limit", type=int, default=None, metavar="N",
                   help="branch-and-bound nodes per sharding ILP solve (default autopar.plan's; 0: no limit)")
    p.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE, metavar="F",
                   help=f"plans within this fraction of the fastest are ties, as for `autopar plan` (default "
                        f"{DEFAULT_TIE_TOLERANCE:g}; 0: the fastest)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes solving sizes side by side (default: one per CPU, at most one per size; 1: none)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the chart (throughput, MFU, time and cost)")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the table as CSV (SI units)")
    p.add_argument("--json", action="store_true", help="print the sweep as JSON (SI units) instead of the table")
    p.add_argument("--save-plans", default=None, metavar="DIR",
                   help="save each size's plan as DIR/NODESxPERxDEVICE.json (for show, codegen, compare)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)
