"""Run torch.export (non-strict) on a model plus a loss, and turn failures into CaptureError.

The exported program is the forward pass *to a scalar loss*: Hugging Face models
return a ModelOutput whose ``loss`` we keep (a cache object or logits beside it are
dropped, so ``use_cache=True`` is harmless); other models go through
``loss_fn(output, inputs)``, or, when none is given, the mean of their (first)
floating output, a stand-in that costs nothing next to the model. Which of these made the loss is
a :class:`~autopar.capture.loss.LossSource` the program carries (:func:`loss_source`): plans record
it, and training refuses a stand-in (loss.py).

``loss_fn`` receives every example input; ``forward`` only the keyword inputs its signature takes
(an untyped ``**kwargs`` takes every key, a typed one, ``Unpack[SomeTypedDict]`` as Hugging Face's,
that dict's keys). Targets and masks that only the loss reads are keys forward does
not take: they are inputs of the exported program like any other, read by the loss's ops alone, so
they are micro-batched, sharded and sent to the pipeline stage that computes the loss like the rest.

Nodes carry no stack traces (recording one per node cost 10-25% of a small model's export and 19%
of GPT-3 175B's capture, bench/capture_175b.py): only a capture error names a source line, and
:func:`~autopar.capture.capture` exports once more with them to write that error.

An explicit attention mask that is the causal triangle, computed from shapes alone, runs as
``is_causal=True`` (capture/causal.py), as the model's own eager step runs it.

Hugging Face experts set to ``experts_implementation="eager"`` (a loop with data-dependent
shapes) are exported with a static implementation of the same maths (capture/moe.py).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
import typing
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..errors import CaptureError, ConfigError
from . import functions
from .causal import causal_masks
from .last_selected import last_selected
from ..plan.loss import MODEL, STAND_IN, LossSource
from .moe import static_experts

LossFn = Callable[[Any, Any], torch.Tensor]
LOSS_META = "autopar_loss"   # the exported graph module's meta key of its LossSource (run_export)
# Frames that are not the user's model code: torch, autopar's capture, transformers' wrappers.
INTERNAL_PATHS = (os.sep + "torch" + os.sep, os.sep + "autopar" + os.sep + "capture" + os.sep, "<frozen",
                  "contextlib.py", os.sep + "transformers" + os.sep + "utils" + os.sep)


class LossWrapper(nn.Module):
    """``forward(*args, **kwargs) -> scalar loss`` around a user model: the model gets the keyword inputs
    its ``forward`` takes, ``loss_fn`` all of them. ``on_loss`` is told how the loss was made."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None, inputs: Any,
                 on_loss: Callable[[LossSource], None] | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self._inputs = inputs  # passed to loss_fn as given (dict or tuple)
        self._keys = forward_keys(model)
        self._on_loss = on_loss

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        taken = kwargs if self._keys is None else {k: v for k, v in kwargs.items() if k in self._keys}
        out = self.model(*args, **taken)
        if self.loss_fn is not None:
            loss, source = self.loss_fn(out, kwargs if kwargs else args), LossSource.of(self.loss_fn)
        else:
            loss, source = extract_loss(out)
        if self._on_loss is not None:
            self._on_loss(source)
        return loss


def extract_loss(out: Any) -> tuple[torch.Tensor, LossSource]:
    """The scalar loss in a model output and how it was made: ``out.loss`` or a scalar tensor (the
    model's own), else the mean of its first floating tensor (a stand-in)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, LossSource(MODEL)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out, LossSource(MODEL)
    first = _first_float_tensor(out)
    if first is None:
        raise CaptureError(
            f"the model returned {type(out).__name__} with no loss and no floating tensor: pass "
            "labels in example_inputs (Hugging Face models) or loss_fn=lambda output, inputs: ...")
    return first.float().mean(), LossSource(STAND_IN)


def loss_source(program: torch.export.ExportedProgram) -> LossSource:
    """How the loss of a program :func:`run_export` made was made."""
    return program.graph_module.meta[LOSS_META]


def _first_float_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (list, tuple)) else ()
    for v in values:
        found = _first_float_tensor(v)
        if found is not None:
            return found
    return None


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Split example inputs into (args, kwargs); a lone tensor becomes a 1-tuple."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise ConfigError(f"example_inputs must be a tensor, a tuple of tensors or a dict of keyword tensors, "
                      f"got {type(example_inputs).__name__}")


def check_model(model: Any, meta_mix: bool = False) -> None:
    """Refuse what cannot be planned: not a module, no trainable parameters, mixed devices (but
    ``meta_mix``: meta and one other device, a model built on meta whose own init made some
    tensors elsewhere)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(f"{type(model).__name__} has no trainable parameters: there is nothing to train "
                          "or parallelize (check requires_grad)")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1 and not (meta_mix and len(devices) == 2 and "meta" in devices):
        raise ConfigError(f"{type(model).__name__} has parameters on several devices {devices}: move the whole "
                          "model to one device (or to 'meta') before planning")


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, stand_in: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """While open, each parameter and buffer ``t`` of ``model`` for which ``stand_in(t)`` is not None is
    that stand-in (a parameter's wrapped as a parameter with its ``requires_grad``; a tensor held twice,
    a tie, gets one stand-in), and put back after, whatever happens."""
    swapped: list[tuple[nn.Module, str, str, Any]] = []   # (module, "_parameters"/"_buffers", name, original)
    copies: dict[int, Any] = {}
    for module in model.modules():
        for slot in ("_parameters", "_buffers"):
            for name, t in list(getattr(module, slot).items()):
                if t is None:
                    continue
                if id(t) not in copies:
                    copy = stand_in(t)
                    copies[id(t)] = copy if copy is None or slot != "_parameters" \
                        else nn.Parameter(copy, requires_grad=t.requires_grad)
                if copies[id(t)] is None:
                    continue
                swapped.append((module, slot, name, t))
                getattr(module, slot)[name] = copies[id(t)]
    try:
        yield
    finally:
        for module, slot, name, t in swapped:
            getattr(module, slot)[name] = t


@contextlib.contextmanager
def all_on_meta(model: nn.Module) -> Iterator[None]:
    """While open, a model that is mostly on meta has all of it there: its parameters and buffers on
    another device (made by its own init despite the meta device: ``torch.FloatTensor(...)``,
    XLNet's ``mask_emb``) are swapped for meta copies, ties kept, and put back after. Planning needs
    shapes only; a model wholly on one device is left alone."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors) or all(t.is_meta for t in tensors):
        yield
        return
    with swapped_tensors(model, lambda t: None if t.is_meta else t.detach().to("meta")):
        yield


def forward_keys(model: nn.Module) -> frozenset[str] | None:
    """The keyword inputs ``model.forward`` takes: its named parameters, and the keys of a typed
    ``**kwargs: Unpack[SomeTypedDict]`` (Hugging Face's TransformersKwargs). None: any (an untyped
    ``**kwargs``, or no signature)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    keys = {k for k, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            typed = typing.get_args(p.annotation) if typing.get_origin(p.annotation) is typing.Unpack else ()
            if not (typed and typing.is_typeddict(typed[0])):
                return None
            keys |= typed[0].__required_keys__ | typed[0].__optional_keys__
    return frozenset(keys)


def check_inputs_signature(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn | None) -> None:
    """Name keyword inputs forward does not take, which only a loss_fn reads, and inputs that do not bind,
    before export turns them into an obscure TypeError."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    keys = forward_keys(model)
    extra = [] if keys is None else [k for k in kwargs if k not in keys]
    if extra and loss_fn is None:
        raise CaptureError(f"example_inputs key(s) {extra} are not parameters of {type(model).__name__}.forward{sig}: "
                           "keys forward does not take (targets, masks) go to loss_fn alone: pass a "
                           "loss_fn(output, inputs) that reads them (inputs holds every key), or drop them")
    try:
        sig.bind(*args, **{k: v for k, v in kwargs.items() if k not in extra})
    except TypeError as exc:
        aside = f" (key(s) {extra}, which forward does not take, go to loss_fn alone: a misspelling?)" if extra else ""
        raise CaptureError(f"example_inputs do not match {type(model).__name__}.forward{sig}: {exc}{aside}") from None


def user_frame(exc: BaseException) -> str:
    """``file:line in function: code`` of the deepest frame in the user's code, or ""."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not any(part in frame.filename for part in INTERNAL_PATHS):
            code = f": {frame.line.strip()}" if frame.line else ""
            return f"{frame.filename}:{frame.lineno} in {frame.name}{code}"
    return ""


@contextlib.contextmanager
def training(model: nn.Module):
    """Capture the training graph (dropout on), restoring each submodule's mode afterwards."""
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def run_export(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None, *,
               train_mode: bool = True, stack_traces: bool = False) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of model + loss; every failure becomes a CaptureError.

    ``train_mode``: export the training graph (dropout on) whatever mode the model is in, as planning
    does; False exports each module in the mode it is in, as a rank's program runs it.
    ``stack_traces``: record each node's ``meta["stack_trace"]`` (the model line that made it)."""
    check_model(model, meta_mix=train_mode)
    args, kwargs = normalize_inputs(example_inputs)
    check_inputs_signature(model, args, kwargs, loss_fn)
    made: list[LossSource] = []
    wrapper = LossWrapper(model, loss_fn, example_inputs, made.append)
    with (training(model) if train_mode else contextlib.nullcontext()), static_experts(model), \
            all_on_meta(model), functions.recording() as calls, _recording_stack_traces(stack_traces):
        try:
            program = torch.export.export(wrapper, args, kwargs, strict=False)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as CaptureError with the user's source line
            raise _capture_error(model, exc, call="**" if kwargs else "*") from exc
    functions.check(calls, type(model).__name__)
    program.graph_module.meta[LOSS_META] = made[-1]
    last_selected(program)
    causal_masks(program)
    return program


@contextlib.contextmanager
def _recording_stack_traces(on: bool):
    """Stack traces on or off through torch.fx's switch (a torch without it records them always)."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is None:
        yield
        return
    config.do_not_emit_stack_traces = not on
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _capture_error(model: nn.Module, exc: BaseException, call: str = "*") -> CaptureError:
    where = user_frame(exc)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300].rstrip(".")
    name = type(model).__name__
    data_dependent = any(s in str(exc) for s in ("data-dependent", "DataDependent", "GuardOnDataDependent",
                                                  "Could not guard on data-dependent"))
    if data_dependent:
        hint = ("the model branches on the values of a tensor (data-dependent control flow), which a "
                "static graph cannot capture: rewrite the branch with torch.where / torch.cond, or make it "
                "depend on shapes only")
        if any(p.dim() == 3 for p in model.parameters()):
            hint += ("; a mixture-of-experts layer that loops over the experts it hits is such a branch: "
                     "dispatch with static shapes (Hugging Face: experts_implementation='grouped_mm' or "
                     "'batched_mm'; autopar.models.moe.Experts: a capacity-based dispatch)")
    elif "found at least two devices" in str(exc):
        where_model = next((str(p.device) for p in model.parameters()), None)
        hint = (f"the example inputs are not on the model's device{f' ({where_model})' if where_model else ''}: "
                "make them there (a model built under `with torch.device('meta'):` takes inputs made in the "
                "same block)")
    elif isinstance(exc, (RuntimeError, IndexError, TypeError, ValueError)):
        hint = ("the example inputs do not fit the model (shapes, dtypes or keys): call "
                f"{name}({call}example_inputs) once yourself to see the failure")
    else:
        hint = "torch.export could not trace the model"
    at = f" at {where}" if where else ""
    return CaptureError(f"capturing {name} failed{at}: {type(exc).__name__}: {first}. Hint: {hint}")
