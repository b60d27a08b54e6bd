"""The ``autopar`` command (console script): plan, estimate, show, compare, codegen, export, profile, sweep,
models, demo.

Every command has ``--help``. Errors a user can fix (a bad option, an unknown model, a plan
that does not fit) print one line naming what to change and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from . import commands, profile
from . import sweep
from . import export as export_cmd


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="autopar", description="Auto-parallelization planner for PyTorch training.",
                                  epilog="`autopar COMMAND --help` describes each command.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parsers(sub)
    profile.add_parser(sub)
    sweep.add_parser(sub)
    export_cmd.add_parser(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ..errors import AutoparError
    try:
        return args.run(args)
    except AutoparError as exc:
        print(f"autopar {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:          # `autopar show plan.json | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
