"""MODEL and key=value arguments of the ``autopar`` command.

MODEL is a built-in name (``autopar.models.registry``: built on the meta device, nothing
downloaded) or ``package.module:factory``, a function returning ``(model, example_inputs)``
(the current directory is importable, as with ``python -m``). A factory that takes a
``device`` argument is given ``"meta"`` for planning (nothing is allocated, any size works)
and ``"cpu"`` by the generated ``planned_model.py`` for training; one without is called bare.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
from torch import nn

from ..config import TORCH_DTYPE_NAMES, ParallelConfig
from ..errors import ConfigError
from ..models import registry

DTYPES: Mapping[str, torch.dtype] = {name: getattr(torch, torch_name) for name, torch_name in TORCH_DTYPE_NAMES.items()}

ALIASES: Mapping[str, str] = {"mbs": "micro_batch_size", "mb": "micro_batch_size", "v": "virtual_stages",
                              "sp": "sequence_parallel"}
"""Short names accepted in --fixed / --config (the summary's own abbreviations)."""


@dataclass(frozen=True)
class LoadedModel:
    """A model for the command: the module, its example inputs, and how to build it again (codegen)."""

    name: str
    model: nn.Module
    inputs: Any
    source: Mapping[str, Any]     # {"model": MODEL, "seq_len": int | None, "dtype": "bf16"}: plan.extra["model"]


def load_model(spec: str, *, seq_len: int | None = None, dtype: str = "bf16", device: str = "meta") -> LoadedModel:
    """Build MODEL (module docstring) on ``device`` in ``dtype``."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = {"model": spec, "seq_len": seq_len, "dtype": dtype}
    if ":" not in spec:
        model, inputs = registry.build(spec, seq_len=seq_len, device=device, dtype=DTYPES[dtype])
        return LoadedModel(spec, model, inputs, source)
    if seq_len is not None:
        raise ConfigError(f"--seq-len applies to built-in models only; {spec!r} builds its own inputs")
    result = call_factory(spec, device)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ConfigError(f"{spec} must return (model, example_inputs), got {type(result).__name__}: "
                          "return the nn.Module and a tuple or dict of example tensors (batch on dim 0)")
    return LoadedModel(spec, result[0], result[1], source)


def call_factory(spec: str, device: str) -> Any:
    """Import ``package.module:function`` and call it (with ``device=`` when it takes one)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"MODEL {spec!r} must be a built-in name ({', '.join(registry.names())}) "
                          "or 'package.module:function'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for MODEL {spec!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{module_name} has no function {attr!r} (MODEL {spec!r})")
    return fn(device=device) if "device" in inspect.signature(fn).parameters else fn()


def parse_fields(text: str, option: str) -> dict[str, Any]:
    """"tp=8,pp=4,schedule=interleaved" -> {"tp": 8, "pp": 4, "schedule": "interleaved"}, typed by
    ParallelConfig's fields (ints, true/false, names; stage_recompute as full/none/none)."""
    types = {f.name: f.type for f in fields(ParallelConfig)}
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if not sep or not value.strip():
            raise ConfigError(f"{option} {item!r} must be name=value, e.g. {option} tp=8,pp=4")
        if key not in types:
            raise ConfigError(f"{option}: unknown field {key!r}; known: {', '.join(types)} "
                              f"(and {', '.join(f'{k}={v}' for k, v in ALIASES.items())})")
        out[key] = _typed(key, value.strip(), str(types[key]), option)
    return out


def _typed(key: str, value: str, annotation: str, option: str) -> Any:
    if annotation == "int":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{option} {key}={value!r} must be an integer") from None
    if annotation == "bool":
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{option} {key}={value!r} must be true or false")
    if key == "stage_recompute":
        return tuple(value.split("/"))
    return value
