"""Helpers shared by the model builders: config checks, construction on a device, example inputs.

Nothing here is public; the builders in this package are.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import nn

from ..errors import ConfigError

M = TypeVar("M", bound=nn.Module)

INPUT_SEED = 0
"""Seed of the generator that draws example inputs, so that they do not depend on global RNG state."""


def check_int(name: str, value: Any, low: int = 1) -> None:
    """Raise ConfigError unless ``value`` is an int (not a bool) and at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ConfigError(f"{name}={value} is out of range: it must be >= {low}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def check_bool(name: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_probability(name: str, value: Any) -> None:
    """Raise ConfigError unless ``value`` is a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name}={value!r} is out of range: it must be a float in [0, 1)")


def normal_init(module: nn.Module, std: float) -> None:
    """GPT-2 / Megatron / BERT init of one module: Normal(0, std) Linear and Embedding weights, zero Linear
    biases (norms keep their own). The models' ``_init_weights(module)`` methods (Hugging Face's
    convention, which parallelize runs on a meta model's modules) call it."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def construct(factory: Callable[[], M], device: torch.device | str, dtype: torch.dtype) -> M:
    """Build ``factory()`` directly on ``device`` (no host copy on "meta") and cast floats to ``dtype``.

    Casting keeps parameter identity, so tied weights stay tied.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    with torch.device(device):
        model = factory()
    return model.to(dtype=dtype)


def random_tokens(batch: int, seq: int, vocab: int, device: torch.device | str,
                  offset: int = 0) -> torch.Tensor:
    """Token ids of shape (batch, seq), int64, drawn from a fixed seed (``offset`` varies the stream).

    On "meta" only the shape and dtype exist, so nothing is drawn.
    """
    check_int("batch_size", batch)
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(INPUT_SEED + offset)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def random_floats(shape: tuple[int, ...], device: torch.device | str,
                  dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal tensor of ``shape`` from a fixed seed; shape only on "meta"."""
    check_int("batch_size", shape[0])
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    gen = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
