"""The distributed tests share one spawned world per size for the whole session (worlds.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import worlds  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _shared_worlds():
    yield
    worlds.close_all()
