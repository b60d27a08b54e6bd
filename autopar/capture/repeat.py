"""Planning's export: each repeated block traced a few times, not 96 or 126 times.

torch.export's tracing costs about the same for every op (0.1 s a GPT-2 block, more a Llama one),
so a 96-layer model costs 96 times one layer. Transformer layers repeat: :func:`find_blocks` finds
each container of blocks (an ``nn.ModuleList`` or ``nn.Sequential`` of modules, outermost only) whose
blocks are interchangeable: the same class, parameter and buffer names, shapes, dtypes and
``requires_grad``, and the same non-tensor attributes through every submodule (sliding windows,
attention types, MoE-or-dense choices: what a config sets per layer), but for an integer attribute
that holds each block's own index (Hugging Face's ``layer_idx``). Blocks that differ are another
kind; the kinds' sequence is a *lead* of blocks unlike the rest (T5's first block with its
relative-position table, DeepSeek's dense first layers) followed by a repeating *period* (1; 2 for
Gemma2's alternating sliding and global layers; 6 for Gemma3's).

:func:`export_program` then exports the model with each such container holding only its lead and
three periods (restored afterwards, whatever happens) and expands that program to the whole depth
(capture/expand.py: copies of the third period, checked against the second by capture/periods.py, so
that what a block reads of the block before it and of the values computed before the blocks is seen,
not assumed). The result equals the export of every block, op for op and name for name.

Whenever something does not fit (blocks not interchangeable, fewer blocks than three periods and
one more, a forward that fails, reads the blocks' count or walks them again, or reads a block's value
after the blocks but the last one's, when the container is cut; a period that does not repeat
exactly), every block is exported, as before: only slower, never different. What a cut trace cannot
show is Python that treats a block by its position in the loop in a way the traced blocks do not
exhibit: ``if i == 50``, or a comparison with the configured depth (``config.num_hidden_layers - 1``)
rather than the container's length (which is counted). Every architecture of transformers'
registries is checked against tracing every block (tests/unit/capture/test_repeat_registry.py, in
make bench); for a model of one's own that does so, ``AUTOPAR_TRACE_EVERY_BLOCK=1`` exports every
block (plans do not otherwise depend on it). Only planning's capture copies blocks; the runtime, the
profiler's timing exports and the standalone emit export the whole model, which they run.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import types
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterator

import torch
from torch import nn
from torch.fx.experimental import proxy_tensor

from ..progress import module_calls
from .expand import expand
from .periods import Blocks, Mismatch
from .export import LossFn, run_export

ENV = "AUTOPAR_TRACE_EVERY_BLOCK"
PERIODS = 3   # periods traced: the third is checked against the second, which reads the first
_CONTAINERS = (nn.ModuleList, nn.Sequential)
# a module's own bookkeeping, not what it computes (hooks are compared: they can change the trace)
_INTERNAL = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                       "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                       "_load_state_dict_post_hooks", "_is_full_backward_hook"})
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, type, types.FunctionType, types.BuiltinFunctionType)


@dataclass(frozen=True)
class Outcome:
    """How the program capture planned from was made."""

    copied: tuple[str, ...] = ()    # e.g. "model.layers: 3 of 126 blocks traced"
    skipped: tuple[str, ...] = ()   # block containers not copied, and why
    fallback: str = ""              # why every block was exported ("" when copying was not refused)


@dataclass(frozen=True)
class _Found:
    blocks: Blocks
    container: nn.Module


def export_program(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None, *,
                   progress: bool = False) -> tuple[Any, Outcome]:
    """The program capture reads (an ExportedProgram, or expand.Expanded) and how it was made."""
    found, skipped = ([], ()) if os.environ.get(ENV, "") not in ("", "0") else find_blocks(model)
    if found:
        try:
            return _copied(model, example_inputs, loss_fn, found, progress), Outcome(
                tuple(f"{f.blocks.path or '(model)'}: {f.blocks.traced} of {f.blocks.size} blocks traced"
                      for f in found), skipped)
        except Mismatch as exc:
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - the cut model failed to export: the whole one decides
            why = f"the cut model does not export: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        skipped = (*skipped, why)
    return _export(model, example_inputs, loss_fn, progress), Outcome((), skipped, why if found else "")


def _export(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None, progress: bool) -> Any:
    """run_export with a bar of the blocks the model holds (cut or not); one call site, so that a warning
    the export gives shows once when a cut model falls back to the whole one."""
    with module_calls(repeated_blocks(model), "autopar: capturing", "layers", enabled=progress):
        return run_export(model, example_inputs, loss_fn)


def _copied(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None, found: list[_Found],
            progress: bool) -> Any:
    with _cut(found) as cut, _Counters(found) as counters:
        program = _export(model, example_inputs, loss_fn, progress)
    marks = counters.check(program.graph)
    for f, blocks, counts in zip(found, cut, marks):
        if blocks.walks > (0 if counts is None else 1):
            raise Mismatch(f"{f.blocks.path}: the forward goes through the blocks {blocks.walks} times (a loop over "
                           "them besides the one that runs them, or their count)")
    return expand(program, [f.blocks for f in found], marks)


class _Blocks(dict):
    """A cut container's ``_modules``: counts, while the model is traced, the reads that go through all
    its blocks or take their count (a forward whose other ops depend on them would change when cut)."""

    walks = 0

    def _walk(self) -> None:
        if proxy_tensor.get_proxy_mode() is not None:
            self.walks += 1

    def values(self):
        self._walk()
        return super().values()

    def items(self):
        self._walk()
        return super().items()

    def keys(self):
        self._walk()
        return super().keys()

    def __iter__(self):
        self._walk()
        return super().__iter__()

    def __len__(self) -> int:
        self._walk()
        return super().__len__()


@contextlib.contextmanager
def _cut(found: list[_Found]) -> Iterator[list[_Blocks]]:
    """While open, each container holds only its traced blocks."""
    saved, cut = [], []
    try:
        for f in found:
            modules = f.container._modules
            saved.append((f.container, modules))
            cut.append(_Blocks(list(modules.items())[:f.blocks.traced]))
            f.container.__dict__["_modules"] = cut[-1]
        yield cut
    finally:
        for container, modules in saved:
            container.__dict__["_modules"] = modules


class _Counters:
    """torch.fx's op-name counters of the graph being traced, noted as each traced block is entered
    (a forward pre-hook that reads nothing of the call, first of the block's hooks)."""

    def __init__(self, found: list[_Found]) -> None:
        self.found = found
        self.marks: list[list[tuple[int, Any, dict]]] = [[] for _ in found]
        self.hooks: list[Any] = []

    def __enter__(self) -> "_Counters":
        for i, f in enumerate(self.found):
            for b, block in enumerate(f.container._modules.values()):
                self.hooks.append(block.register_forward_pre_hook(functools.partial(self._mark, i, b), prepend=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self.hooks:
            hook.remove()

    def _mark(self, i: int, b: int, *_: Any) -> None:
        mode = proxy_tensor.get_proxy_mode()
        graph = getattr(getattr(mode, "tracer", None), "graph", None)
        counts = getattr(getattr(graph, "_graph_namespace", None), "_base_count", None)
        self.marks[i].append((b, graph, dict(counts) if counts is not None else None))

    def check(self, graph: Any) -> list[list[dict] | None]:
        """Per container, the counters at each traced block's entry (checked: each block entered once,
        in order, while tracing the program's own graph); None for a container whose blocks did not run
        (a vision tower given no image)."""
        out: list[list[dict] | None] = []
        for f, marks in zip(self.found, self.marks):
            if not marks:
                out.append(None)
                continue
            if [b for b, _, _ in marks] != list(range(f.blocks.traced)):
                raise Mismatch(f"{f.blocks.path}: blocks called {[b for b, _, _ in marks]}, not each once in order")
            if any(g is not graph or counts is None for _, g, counts in marks):
                raise Mismatch(f"{f.blocks.path}: a block ran outside the traced graph")
            out.append([counts for _, _, counts in marks])
        return out


# --- finding the blocks ------------------------------------------------------------------------

def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, as a progress bar counts them: the children of each ModuleList or
    Sequential of two or more modules of one class (transformer layers), outermost only (not the
    experts inside a layer)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, _CONTAINERS):
            continue
        children = list(module.children())
        if len(children) > 1 and len({type(c) for c in children}) == 1:
            blocks += children
            inside.update(id(m) for c in children for m in c.modules())
    return blocks


def find_blocks(model: nn.Module) -> tuple[list[_Found], tuple[str, ...]]:
    """The containers whose blocks can be copied, and a line for each other block container."""
    modules = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    tensors = Counter(id(t) for _, t in chain(model.named_parameters(remove_duplicate=False),
                                              model.named_buffers(remove_duplicate=False)))
    found: list[_Found] = []
    skipped: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        children = [c for c in module._modules.values()]
        if isinstance(module, _CONTAINERS) and len(children) > 1 and not any(
                c is None or isinstance(c, (*_CONTAINERS, nn.ModuleDict)) for c in children):
            blocks, why = _blocks(module, path, modules, tensors)
            if blocks is not None:
                found.append(_Found(blocks, module))
            elif why:
                skipped.append(why)
            return   # outermost only: experts inside a layer are not blocks
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return found, tuple(skipped)


def _blocks(container: nn.Module, path: str, modules: Counter, tensors: Counter) -> tuple[Blocks | None, str]:
    name = path or "(model)"
    items = list(container._modules.items())
    n = len(items)
    if [k for k, _ in items] != [str(i) for i in range(n)]:
        return None, f"{name}: its blocks are not named 0..{n - 1}"
    children = [c for _, c in items]
    for b, child in enumerate(children):
        if any(modules[id(m)] != 1 for _, m in child.named_modules(remove_duplicate=False)) or any(
                tensors[id(t)] != 1 for _, t in chain(child.named_parameters(remove_duplicate=False),
                                                      child.named_buffers(remove_duplicate=False))):
            return None, f"{name}: block {b} shares a module or a weight"
    index = set.intersection(*(_index_attributes(c, b) for b, c in enumerate(children)))
    keys: dict[Any, int] = {}
    kinds = [keys.setdefault(_signature(c, index), len(keys)) for c in children]
    lead, period = _pattern(kinds)
    if lead + PERIODS * period >= n:
        return None, f"{name}: {n} blocks, not more than a lead of {lead} and {PERIODS} periods of {period}"
    return Blocks(path, n, lead, period), ""


def _pattern(kinds: list[int]) -> tuple[int, int]:
    """(lead, period) with the fewest traced blocks ``lead + PERIODS * period``: the kinds from
    ``lead`` on repeat with ``period``."""
    best = (len(kinds), len(kinds))
    for p in range(1, len(kinds) // PERIODS + 1):
        violations = [i for i in range(p, len(kinds)) if kinds[i] != kinds[i - p]]
        lead = violations[-1] - p + 1 if violations else 0
        if lead + PERIODS * p < best[0] + PERIODS * best[1]:
            best = (lead, p)
    return best


def _index_attributes(child: nn.Module, index: int) -> set[tuple[str, str]]:
    """(submodule, attribute) of the integer attributes that equal the block's index."""
    return {(path, k) for path, m in child.named_modules(remove_duplicate=False)
            for k, v in vars(m).items() if type(v) is int and v == index}


def _signature(child: nn.Module, index: set[tuple[str, str]]) -> tuple:
    """What two blocks must share to be interchangeable (module docstring), hashable."""
    inside = {id(m): path for path, m in child.named_modules(remove_duplicate=False)}
    memo: dict[int, Any] = {}
    out: list[Any] = []
    for path, m in child.named_modules(remove_duplicate=False):
        params = tuple((k, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad, p.device.type))
                       for k, p in m._parameters.items())
        buffers = tuple((k, None if t is None else (tuple(t.shape), t.dtype, t.device.type,
                                                    k in m._non_persistent_buffers_set))
                        for k, t in m._buffers.items())
        attrs = tuple((k, "<index>" if (path, k) in index else _value(v, inside, memo, 0))
                      for k, v in vars(m).items() if k not in _INTERNAL)
        out.append((path, type(m), params, buffers, attrs))
    return tuple(out)


def _stateful(module: nn.Module) -> bool:
    """Whether a module holds parameters or buffers (anywhere inside): then only itself is itself."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _value(v: Any, inside: dict[int, str], memo: dict[int, Any], depth: int) -> Any:
    """A hashable stand-in for an attribute's value: equal for equal values (objects compared by their
    attributes a few levels deep, the same object always equal)."""
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if id(v) in memo:
        return memo[id(v)]
    if isinstance(v, nn.Module) and (id(v) in inside or depth >= 3 or _stateful(v)):
        key: Any = ("module", inside.get(id(v), id(v)))
    elif isinstance(v, nn.Module):   # a stateless helper each block holds its own of (transformers v5's kernel
        memo[id(v)] = ("module", id(v))   # functions, ``_kernel_funcs``): alike when its type and attributes are
        key = ("stateless module", type(v), _value({k: x for k, x in vars(v).items() if k not in _INTERNAL},
                                                   inside, memo, depth + 1))
    elif isinstance(v, torch.Tensor):
        key = ("tensor", tuple(v.shape), v.dtype, v.device.type, v.requires_grad)
    elif isinstance(v, (tuple, list)):
        key = (type(v), tuple(_value(x, inside, memo, depth) for x in v))
    elif isinstance(v, dict):
        key = (type(v), tuple((_value(k, inside, memo, depth), _value(x, inside, memo, depth)) for k, x in v.items()))
    elif isinstance(v, (set, frozenset)):
        key = (type(v), frozenset(_value(x, inside, memo, depth) for x in v))
    elif isinstance(v, types.MethodType):
        key = ("method", v.__func__, _value(v.__self__, inside, memo, depth))
    elif isinstance(v, functools.partial):
        key = ("partial", _value(v.func, inside, memo, depth), _value(v.args, inside, memo, depth),
               _value(v.keywords, inside, memo, depth))
    elif depth < 3 and hasattr(v, "__dict__"):
        memo[id(v)] = ("object", id(v))   # a cycle back to it compares by identity
        key = ("object", type(v), _value(vars(v), inside, memo, depth + 1))
    else:
        key = ("object", id(v))
    memo[id(v)] = key
    return key
