"""The export tests' plans, loaded once; their helper modules (cases, make_goldens, export_schemas) import
from this folder."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cases import load_plans  # noqa: E402


@pytest.fixture(scope="session")
def plans():
    return load_plans()
