"""``autopar export PLAN.json --to torchtitan|megatron|deepspeed|accelerate``: write a saved plan in the
configuration a training stack reads (autopar/exports), and say what the stack cannot express.

Without ``-o`` the file's text goes to standard output and the warnings to standard error, so the
output can be redirected as it is; with ``-o`` the file is written and the warnings printed.
``--trace`` lists every written field with the plan fields it came from and the stack's documentation.
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from ..exports import export
    from ..plan import load_plan
    result = export(load_plan(args.plan), args.to)
    if args.output:
        result.write(args.output)
        print(f"wrote {args.output} ({result.stack}, {len(result.fields)} fields)")
        report = sys.stdout
    else:
        sys.stdout.write(result.text)
        report = sys.stderr
    if args.trace:
        print(f"{result.stack} fields and the plan fields they came from:", file=report)
        for f in result.fields:
            origin = ", ".join(f.sources) if f.sources else "(fixed by the format)"
            print(f"  {f.key} = {f.value!r:.60}  <- {origin}  [{f.doc}]", file=report)
    if result.warnings:
        print(f"{result.stack} cannot express {len(result.warnings)} thing(s) of the plan:", file=report)
        for w in result.warnings:
            print(f"  - {w}", file=report)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..exports import STACKS
    exp = sub.add_parser("export", help="write a saved plan as torchtitan / Megatron-LM / DeepSpeed / accelerate config",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    exp.add_argument("plan", help="plan JSON file (autopar plan -o, Plan.save)")
    exp.add_argument("--to", required=True, choices=STACKS, help="the training stack")
    exp.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="write the configuration here (default: print it)")
    exp.add_argument("--trace", action="store_true", help="also list each field's plan source and documentation")
    exp.set_defaults(run=run)
