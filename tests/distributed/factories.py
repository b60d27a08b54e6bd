"""Model and batch factories the emitted training script imports (``factories:gpt2_model``)."""

from __future__ import annotations

from harness import MODELS, batches


def gpt2_model():
    return MODELS["gpt2"]()


def gpt2_batch(step: int, global_batch: int):
    return batches("gpt2", step + 1, global_batch)[step]
