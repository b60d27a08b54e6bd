"""Custom ``torch.autograd.Function``s under torch.export: the exported graph keeps only their forward.

torch.export (non-strict, as capture runs it) traces a Function's ``forward`` into the graph and
drops its ``backward``: the program autopar builds differentiates the forward's ops with autograd
instead. That trains the same only when the Function's backward is the gradient of its forward (a
hand-written GELU derivative, a memory-saving recompute), not when it is something else (YOSO's
approximate attention gradient, a straight-through estimator, a gradient reversal).

So :func:`recording` notes every Function with its own backward that the forward calls (outside
torch itself), with the shapes of its first call, and :func:`check` runs each once on random
float64 inputs of those shapes: its backward against autograd through its forward, for one random
output cotangent. One whose gradients differ (beyond 1e-6 of the largest) is refused with a
CaptureError naming it. A call too large to check on the host (over ``CHECK_LIMIT`` input
elements) is not checked and a warning says so. Nothing in torch.export reports a dropped backward,
hence this module.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.autograd.function import Function, _SingleLevelFunction

from ..errors import CaptureError

CHECK_LIMIT = 1 << 22   # input elements of one checked call (float64: 32 MiB)
TOLERANCE = 1e-6        # relative to the largest gradient element


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor argument of a recorded call, by what checking it needs."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Call:
    """A Function's first call: its arguments, tensors replaced by their _TensorSpec."""

    function: type
    args: tuple
    kwargs: dict


def _custom_backward(cls: type) -> bool:
    return cls.backward is not Function.backward and not cls.__module__.startswith("torch.")


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _TensorSpec(tuple(x.shape), x.dtype, bool(x.requires_grad))
    return x


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Record, while open, the first call of every custom-backward Function (Function.apply patched)."""
    calls: list[Call] = []
    seen: set[type] = set()
    original = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls not in seen and _custom_backward(cls):
            seen.add(cls)
            calls.append(Call(cls, tuple(_spec(a) for a in args), {k: _spec(v) for k, v in kwargs.items()}))
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)
    try:
        yield calls
    finally:
        Function.apply = original


class _Ctx:
    """What a Function's forward may call on ``ctx``, for running it outside autograd.Function."""

    def __init__(self, inputs: tuple) -> None:
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in inputs)
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _forward_through_autograd(cls: type, args: tuple, kwargs: dict) -> Any:
    if cls.setup_context is not _SingleLevelFunction.setup_context:   # forward(*args), setup_context apart
        return cls.forward(*args, **kwargs)
    return cls.forward(_Ctx(args), *args, **kwargs)


def _input_numel(call: Call) -> int:
    return sum(torch.Size(x.shape).numel() for x in (*call.args, *call.kwargs.values()) if isinstance(x, _TensorSpec))


def _materialise(call: Call, scale: float) -> tuple[tuple, dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    leaves: list[torch.Tensor] = []

    def make(x: Any) -> Any:
        if not isinstance(x, _TensorSpec):
            return x
        if x.dtype.is_floating_point:
            t = torch.randn(x.shape, dtype=torch.float64, generator=gen) * scale
            if x.requires_grad:
                t.requires_grad_(True)
                leaves.append(t)
            return t
        return torch.ones(x.shape, dtype=x.dtype)   # masks and lengths: all on

    return tuple(make(a) for a in call.args), {k: make(v) for k, v in call.kwargs.items()}, leaves


def _outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _both_gradients(call: Call, name: str, model_name: str) -> tuple[tuple, tuple] | None:
    """The Function's backward and autograd through its forward, for the same random inputs and output
    cotangent; inputs of standard deviation 1, else 0.1 or 0.01 where 1 leaves its domain (YOSO takes
    the arc cosine of q k^T). None when no input needs a gradient."""
    failure = "its outputs or gradients are not finite on random inputs"
    for scale in (1.0, 0.1, 0.01):
        args, kwargs, leaves = _materialise(call, scale)
        if not leaves:
            return None
        try:
            custom = _outputs(call.function.apply(*args, **kwargs))
            cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(1))
                          for o in custom]
            want = torch.autograd.grad(custom, leaves, cotangents, allow_unused=True)
            traced = _outputs(_forward_through_autograd(call.function, args, kwargs))
            got = torch.autograd.grad(traced, leaves, cotangents, allow_unused=True)
        except Exception as exc:  # noqa: BLE001 - a Function that cannot run here cannot be checked
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
            break
        if all(bool(torch.isfinite(t).all()) for t in (*want, *got) if t is not None):
            return want, got
    raise CaptureError(
        f"{model_name} calls {name}, a torch.autograd.Function with its own backward, which torch.export drops "
        f"(the graph keeps its forward), and it could not be checked ({failure}): rewrite it with differentiable "
        "torch ops")


def check(calls: list[Call], model_name: str) -> None:
    """Refuse (CaptureError) a recorded Function whose backward is not the gradient of its forward."""
    for call in calls:
        name = f"{call.function.__module__}.{call.function.__qualname__}"
        if _input_numel(call) > CHECK_LIMIT:
            warnings.warn(f"{model_name} calls {name}, a torch.autograd.Function with its own backward, on inputs "
                          f"too large to check here: autopar trains it with autograd's gradient of its forward, "
                          "which equals its backward only if that backward is the exact gradient", stacklevel=3)
            continue
        grads = _both_gradients(call, name, model_name)
        if grads is None:
            continue
        want, got = grads
        zero = torch.zeros(())
        pairs = [(w if w is not None else zero, g if g is not None else zero) for w, g in zip(want, got)]
        largest = max((float(w.abs().max()) for w, _ in pairs if w.numel()), default=0.0)
        worst = max((float((w - g).abs().max()) for w, g in pairs if (w - g).numel()), default=0.0)
        if worst > TOLERANCE * max(largest, 1e-30):
            raise CaptureError(
                f"{model_name} calls {name}, a torch.autograd.Function whose backward is not the gradient of its "
                f"forward (on random inputs they differ by {worst:.3g}, the largest gradient being {largest:.3g}); "
                "torch.export keeps only the forward, so a parallel program would train it with autograd's "
                "gradient instead, and differ from one device: rewrite it with differentiable torch ops (or "
                "with a forward whose autograd gradient is the one you want)")
