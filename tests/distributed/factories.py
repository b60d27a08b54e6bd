"""Model and batch factories the emitted training script imports (``factories:gpt2_model``)."""

from __future__ import annotations

from harness import MODELS, batches


def gpt2_model():
    return MODELS["gpt2"]()


def gpt2_batch(step: int, global_batch: int):
    return batches("gpt2", step + 1, global_batch)[step]


def llama_from_config(device: str = "cpu"):
    """A Hugging Face Llama built from its config, as a user's factory for ``autopar plan`` writes it: on
    ``device`` (``"meta"`` to plan), with batch-1 example inputs."""
    import new_users
    model = new_users.build("llama", device)
    example = new_users.rows(new_users.batches("llama", 1, 1, device)[0], 0, 1)
    return model, example


def llama_batch(step: int, global_batch: int):
    import new_users
    return new_users.batches("llama", step + 1, global_batch)[step]
