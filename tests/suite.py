"""How much of the larger test matrices a run covers: a fixed sample by default (``make test``), all of
them with ``AUTOPAR_ALL_CASES=1`` (``make bench`` sets it). One switch, read here for both halves of
the suite: tests/ is on ``sys.path`` (tests/conftest.py's folder), and the distributed tests' spawned
ranks inherit the parent's path."""

from __future__ import annotations

import os

ALL_CASES = bool(os.environ.get("AUTOPAR_ALL_CASES"))
