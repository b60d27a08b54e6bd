"""The dtypes a real kernel requires to agree, checked on the exported graph.

On the meta device (where planning traces the model) torch.export runs the ops' shape functions, not
their kernels, and several of those do not check dtypes: a ``linear`` / ``matmul`` of a bfloat16 (or
int64) input with a float32 weight, or a bias-free ``conv2d`` of an int64 image, exports without a
word, then fails on every real device ("expected m1 and m2 to have the same dtype"). So after
export, for each op whose kernels take one dtype for all their data operands (matrix products,
convolutions, attention: ``OPERANDS`` below), the operands' dtypes must agree; when they do not,
:func:`check_dtypes` raises a CaptureError naming the example input (or parameter, or the model's own
cast) each odd operand comes from, and the dtype the model computes in.

Mixed precision real kernels run is not refused: ops inside an autocast region are a higher-order op
of their own (the walk does not enter them), embeddings take integer ids, indexing and masks mix
dtypes freely, norms take a float32 weight with a bfloat16 input, and an op that adds a bool or int
mask to floats promotes as eager does.

A model may also cast an example input itself before its first matrix product (Hugging Face's ViT
casts ``pixel_values`` to its weights' dtype): that runs on real devices, so it is not an error, but
the input's dtype is then not the one the model trains in (int64 pixels, bfloat16 features for a
float32 model). :func:`check_dtypes` returns one note per such input (the plan's notes carry it):
an input whose values reach a matrix product or convolution with a trainable weight through casts
and views alone, in a dtype other than its own.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .. import ops
from ..errors import CaptureError
from ..ops import base_name
from .build import module_path
from .export import normalize_inputs
from .opgraph import OpKind
from .rules import op_kind

# op base name -> the positions of its data operands (the tensors a kernel needs in one dtype); an
# index of -1 is einsum's list of operands (args[1])
OPERANDS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(ops.MATMULS - ops.BIAS_MATMULS - {"linear", "einsum", "_scaled_mm", "grouped_mm_fallback"}, (0, 1)),
    **dict.fromkeys(ops.BIAS_MATMULS | {"linear"} | ops.CONVOLUTIONS | ops.SDPA, (0, 1, 2)),
    "einsum": (-1,),
}

_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)   # (device, dtype, enabled, cache, region, ...)


def _carries(name: str) -> bool:
    """Whether an op passes its (first) input's values on unchanged but for the dtype: a view, copy or cast."""
    return name in ops.CASTS or op_kind(name) is OpKind.VIEW


def _dtype(node: Any) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _operands(node: torch.fx.Node, positions: tuple[int, ...]) -> list[torch.fx.Node]:
    found = []
    for pos in positions:
        arg = node.args[1] if pos == -1 and len(node.args) > 1 else (node.args[pos] if 0 <= pos < len(node.args)
                                                                     else None)
        for leaf in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if _dtype(leaf) is not None:
                found.append(leaf)
    return found


class _Program:
    """What the checks need of an exported program: each placeholder's role and a name for people."""

    def __init__(self, program: ExportedProgram, example_inputs: Any) -> None:
        self.program = program
        self.params: dict[str, str] = {}       # placeholder -> parameter name (trainable or not)
        self.inputs: dict[str, str] = {}       # placeholder -> the example input's name
        specs = program.graph_signature.input_specs
        for spec in specs:
            name = getattr(spec.arg, "name", None)
            if spec.kind is InputKind.PARAMETER and name:
                self.params[name] = (spec.target or name).removeprefix("model.")
        user = [getattr(s.arg, "name", None) for s in specs if s.kind is InputKind.USER_INPUT]
        args, kwargs = normalize_inputs(example_inputs)
        paths = [path for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
        labels = [_label(path) for path in paths] if len(paths) == len(user) else user
        if isinstance(example_inputs, torch.Tensor):
            labels = ["example_inputs"]
        self.inputs = {p: label for p, label in zip(user, labels) if p}
        weights = Counter()
        for node in program.graph.nodes:
            if node.op == "placeholder" and node.name in self.params and _dtype(node) is not None:
                weights[_dtype(node)] += node.meta["val"].numel()
        self.model_dtype = weights.most_common(1)[0][0] if weights else None
        self.outer: dict[torch.fx.Node, torch.fx.Node] = {}   # a region's placeholder -> what its caller passed

    def ops(self, graph: torch.fx.Graph | None = None) -> Iterator[torch.fx.Node]:
        """Every call_function node the kernels run outside autocast: the graph's own, and those of the
        regions torch.export makes higher-order ops of (``with torch.autocast(enabled=False)``, grad mode),
        but not of an enabled autocast region, whose ops autocast casts to one dtype."""
        for node in (graph or self.program.graph).nodes:
            if node.op != "call_function":
                continue
            yield node
            sub = next((a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
            if sub is None or (node.target is _AUTOCAST and node.args[2]):
                continue
            region = getattr(self.program.graph_module, sub.target).graph
            given = [a for a in node.args[node.args.index(sub) + 1:] if isinstance(a, torch.fx.Node)]
            self.outer.update(zip((n for n in region.nodes if n.op == "placeholder"), given))
            yield from self.ops(region)

    def sources(self, node: torch.fx.Node, carried: bool = False) -> list[torch.fx.Node]:
        """The placeholders ``node``'s value comes from: along ops of its own dtype, or (``carried``) along
        views, copies and casts alone (what passes a value on unchanged but for the dtype)."""
        dtype, seen, stack, out = _dtype(node), set(), [node], []
        while stack:
            n = stack.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            if n.op == "placeholder":
                if n in self.outer:          # a region's input: the value it was given
                    stack.append(self.outer[n])
                else:
                    out.append(n)
                continue
            if n.op != "call_function" or (carried and not _carries(base_name(n.target))):
                continue
            for arg in (n.all_input_nodes[:1] if carried else n.all_input_nodes):
                if _dtype(arg) is not None and (carried or _dtype(arg) == dtype):
                    stack.append(arg)
        return out

    def where(self, node: torch.fx.Node) -> str:
        path = module_path(node)
        return f"{base_name(node.target)} in {path}" if path else f"{base_name(node.target)} of the model"


def _label(path: tuple) -> str:
    """The example input at a pytree path of (args, kwargs), as the user wrote it."""
    (top, *rest) = path
    keys = "".join(f"[{k.key!r}]" if isinstance(k, pytree.MappingKey) else f"[{getattr(k, 'idx', k)}]"
                   for k in rest[1:])
    if top.idx == 1:     # a keyword input: its name
        return f"{rest[0].key}{keys}"
    return f"example_inputs[{rest[0].idx}]{keys}"


def _params(info: _Program, operand: torch.fx.Node, carried: bool = True) -> list[str]:
    """The parameters ``operand`` is (through views and casts: a weight, W.t(), W.to(dtype)) or, not
    ``carried``, is computed from in its dtype; the largest first."""
    found = [s for s in info.sources(operand, carried) if s.name in info.params]
    return [info.params[s.name] for s in sorted(found, key=lambda s: -s.meta["val"].numel())]


def check_dtypes(program: ExportedProgram, model_name: str, example_inputs: Any) -> tuple[str, ...]:
    """Raise CaptureError where an op's data operands differ in dtype (a real kernel refuses them);
    return a note for each example input the model casts before a matrix product with its weights."""
    info = _Program(program, example_inputs)
    notes: dict[str, str] = {}
    for node in info.ops():
        positions = OPERANDS.get(base_name(node.target))
        if positions is None:
            continue
        operands = _operands(node, positions)
        dtypes = {_dtype(a) for a in operands}
        if len(dtypes) > 1:
            raise _mixed(info, node, operands, model_name)
        if not any(_params(info, a) for a in operands):
            continue
        for operand in operands:
            for source in info.sources(operand, carried=True):
                name = info.inputs.get(source.name)
                if name is not None and name not in notes and _dtype(source) != _dtype(operand):
                    given, used = _short(_dtype(source)), _short(_dtype(operand))
                    other = (f", or cast the model to {given} to train in {given}"
                             if _dtype(source).is_floating_point else "")
                    notes[name] = (f"{name} is {given} but {model_name} computes in {used}: it casts {name} for "
                                   f"the {info.where(node)}, and the plan is priced so; pass {name} as {used} if "
                                   f"that is what training feeds it{other}")
    return tuple(notes.values())


def _mixed(info: _Program, node: torch.fx.Node, operands: list[torch.fx.Node], model_name: str) -> CaptureError:
    """The error for an op whose operands differ in dtype, naming where each odd operand comes from."""
    dtypes = Counter(_dtype(a) for a in operands)
    weights: dict[torch.dtype, str] = {}     # dtype -> the first parameter operand of it (the weight)
    for a in operands:
        for p in _params(info, a)[:1]:
            weights.setdefault(_dtype(a), p)
    compute = (next(iter(weights)) if weights else
               info.model_dtype if info.model_dtype in dtypes else dtypes.most_common(1)[0][0])
    at = info.where(node)
    for operand in operands:
        if _dtype(operand) == compute:
            continue
        odd = _short(_dtype(operand))
        what = (f"{at} takes {odd} and {_short(compute)} operands, which no real kernel accepts (the meta "
                "device, where the model was traced, does not check)")
        sources = info.sources(operand)
        params = _params(info, operand, carried=False)
        if params:     # the model's own parameters differ in dtype
            weight = f" ({weights[compute]})" if compute in weights else ""
            return CaptureError(f"{model_name}'s parameters mix {odd} ({params[0]}) and {_short(compute)}{weight}: "
                                f"{what}. Hint: cast the whole model to one dtype (model.to(torch.{_short(compute)}))")
        inputs = [info.inputs[s.name] for s in sources if s.name in info.inputs]
        if inputs:
            names = ", ".join(inputs)
            fix = (f"pass {names} as {_short(compute)}" if not _dtype(operand).is_floating_point else
                   f"pass {names} as {_short(compute)}, or cast the model to {odd} (model.to(torch.{odd}))")
            return CaptureError(f"{names} {'is' if len(inputs) == 1 else 'are'} {odd} but {model_name} computes in "
                                f"{_short(compute)}: {what}. Hint: {fix}")
        return CaptureError(f"{model_name}'s {what}: the {odd} operand is made by the model's own ops. Hint: "
                            f"cast both operands of the {base_name(node.target)} to one dtype")
    return CaptureError(f"{model_name}'s {at} takes operands of dtypes "
                        f"{', '.join(sorted(map(_short, dtypes)))}, which no real kernel accepts")
