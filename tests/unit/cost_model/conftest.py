"""Fixtures shared by the cost-model tests."""

from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.models import GPTConfig, build_gpt


@pytest.fixture(scope="session")
def graph():
    """A 4-layer GPT (hidden 1024, sequence 1024, vocabulary 4096) captured on the meta device."""
    model, inputs = build_gpt(GPTConfig(vocab_size=4096, hidden=1024, heads=8, layers=4, seq_len=1024),
                              batch_size=1, device="meta")
    return capture(model, inputs)
