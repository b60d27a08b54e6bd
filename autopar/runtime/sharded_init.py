"""Sharded initialisation: the values of a model built on the meta device, one module at a time.

A model built under ``torch.device("meta")`` has shapes and no values; ``parallelize`` takes it
and each rank materialises only the parameters and buffers it holds (driver/program.py; a
standalone folder's train.py alike, from a copy of this file), so the peak host memory per rank
is about its shard plus one module, never the model.

Values. A module's own tensors (``recurse=False``) are initialised by the model's own code, in
the order a model built on a real device runs it:

1. the module's ``reset_parameters()`` (what ``nn.Linear``, ``nn.Embedding``, the norms run in
   their constructors);
2. the model's ``_init_weights(m)`` (Hugging Face's convention, also autopar.models'), taken from
   the nearest ancestor that defines it (a sub-model's own, as Hugging Face's ``smart_apply``
   dispatches), on the module and then on each of its ancestors, bottom-up as ``nn.Module.apply``
   and Hugging Face's ``smart_apply`` visit them: an ancestor's init may re-initialise a
   descendant's tensor (GPT-2 scales its ``c_proj`` weights from the block). Tensors of other
   modules stay on meta meanwhile, where an init is a no-op.

The CPU random generator is seeded from ``(seed, module name)`` for each module, so a value
depends on the seed and its module's name only: not on the plan, the rank, or which other modules
the rank holds. Every plan, and one process (:func:`init_weights`), get the same values. (They are
not the values an eager build under ``torch.manual_seed`` draws: that draws every module from one
stream in construction order, which a rank holding one stage cannot replay without generating the
whole model. torch's own DTensor random ops (``OffsetBasedRNGTracker``) follow CUDA's Philox
offsets and give values that depend on the mesh, which is what this avoids.)

Check. Floating tensors are filled with NaN and integer ones with their minimum before the init
runs; a tensor still so afterwards has no init this module can run, and is named in a ConfigError
saying what to add.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import nn

from .errors import ConfigError

InitFn = Callable[[nn.Module], None]


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def module_seed(seed: int, module_name: str) -> int:
    """The generator seed of one module's init: a hash of the run's seed and the module's name."""
    digest = hashlib.sha256(f"{int(seed)}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Materializer:
    """Full values of a meta model's tensors, computed one owning module at a time on the CPU.

    ``tensor(name)`` returns a parameter's or buffer's full value by any of its names (a tied
    parameter's aliases give its canonical module's values); a tensor that is not on meta is
    returned as it is. The last module's values are kept, so a module's weight and bias are
    computed once when asked for in turn."""

    def __init__(self, model: nn.Module, seed: int = 0, init: InitFn | None = None) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"init_seed must be an int, got {seed!r}")
        self.model, self.seed, self.init = model, seed, init
        self.modules = dict(model.named_modules(remove_duplicate=False))
        canonical: dict[int, str] = {}
        self.canonical: dict[str, str] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.canonical[name] = canonical.setdefault(id(t), name)
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.canonical:
            raise KeyError(f"{type(self.model).__name__} has no parameter or buffer {name!r}")
        owner, _, attr = self.canonical[name].rpartition(".")
        return self.module_values(owner)[attr]

    def module_values(self, owner: str) -> dict[str, torch.Tensor]:
        """Attribute -> full CPU value of every tensor module ``owner`` holds itself."""
        if self._cached is None or self._cached[0] != owner:
            self._cached = None   # the previous module's values go before the next's are made
            self._cached = (owner, self._compute(owner))
        return self._cached[1]

    def _compute(self, owner: str) -> dict[str, torch.Tensor]:
        module = self.modules[owner]
        slots = [(slot, attr, t) for slot in ("_parameters", "_buffers")
                 for attr, t in getattr(module, slot).items() if t is not None]
        if not any(t.is_meta for _, _, t in slots):
            return {attr: t.detach() for _, attr, t in slots}
        originals = [(slot, attr, t) for slot, attr, t in slots if t.is_meta]
        try:
            for slot, attr, t in originals:
                value = _unset(t)
                getattr(module, slot)[attr] = (nn.Parameter(value, requires_grad=t.requires_grad)
                                               if slot == "_parameters" else value)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(module_seed(self.seed, owner))
                self._run_init(owner, module)
            values = {attr: getattr(module, slot)[attr].detach() for slot, attr, _ in slots}
        finally:
            for slot, attr, t in originals:
                getattr(module, slot)[attr] = t
        unset = [attr for attr, v in values.items() if _still_unset(v)]
        if unset:
            where = f"{owner}.{unset[0]}" if owner else unset[0]
            raise ConfigError(
                f"{where} ({type(module).__name__}) is on the meta device and no init autopar can run sets it: "
                f"give {type(module).__name__} a reset_parameters() method, or the model an _init_weights(module) "
                "method (Hugging Face's convention), or pass parallelize(..., init=fn) where fn(module) "
                "initialises a module's own tensors; or build the model on the CPU")
        return values

    def _run_init(self, owner: str, module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        for name in _ancestors(owner):   # the module itself first, then up to the root
            fn = self.init if self.init is not None else self._model_init(name)
            if fn is not None:
                fn(self.modules[name])

    def _model_init(self, name: str) -> InitFn | None:
        """``_init_weights`` of ``name``'s nearest ancestor-or-self that defines one (taking a module)."""
        for anc in _ancestors(name):
            fn = getattr(self.modules[anc], "_init_weights", None)
            if callable(fn):
                return fn
        return None


def init_weights(model: nn.Module, seed: int = 0, init: InitFn | None = None) -> nn.Module:
    """Materialise a meta model in place on the CPU with the values every rank of ``parallelize``
    gives its shards (the module docstring); ties are kept. Returns the model."""
    mat = Materializer(model, seed, init)
    replaced: dict[int, torch.Tensor] = {}
    for owner, module in model.named_modules():
        for slot in ("_parameters", "_buffers"):
            for attr, t in list(getattr(module, slot).items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in replaced:
                    value = mat.tensor(f"{owner}.{attr}" if owner else attr).clone()
                    replaced[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) \
                        if slot == "_parameters" else value
    for module in model.modules():   # every registration of a tied tensor gets the one new tensor
        for slot in ("_parameters", "_buffers"):
            for attr, t in list(getattr(module, slot).items()):
                if t is not None and id(t) in replaced:
                    getattr(module, slot)[attr] = replaced[id(t)]
    return model


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "a.b", "a", ""]`` (the root is "")."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _unset(meta: torch.Tensor) -> torch.Tensor:
    out = torch.empty(meta.shape, dtype=meta.dtype)
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    if out.dtype == torch.bool:
        return out.fill_(False)
    return out.fill_(torch.iinfo(out.dtype).min)


def _still_unset(value: torch.Tensor) -> bool:
    if value.numel() == 0 or value.dtype == torch.bool:
        return False   # a bool tensor has no value to mark it unset with
    flat = value.reshape(-1)
    for piece in flat.split(1 << 20):   # a piece at a time: no mask the size of the tensor
        if (piece.isnan() if value.is_floating_point() or value.is_complex()
                else piece == torch.iinfo(value.dtype).min).any():
            return True
    return False
