"""What a plan relies on of a model (the record; capture/structure.py builds it from a graph).

The layers in order, and in each its *anchor* ops (those reading parameters, and the matmuls,
attention, convolutions, embeddings, norms and losses) with their kind and the names and shapes of
the parameters they read: :class:`ModelStructure`, stored once per distinct layer body, whose
:attr:`~ModelStructure.fingerprint` plans carry; :func:`first_difference` names the first layer, op
or parameter where two structures differ; :meth:`ModelStructure.shard_units` the ZeRO-2/3 units the
runtime wraps and the cost model counts. Plain data: imports no torch.
"""

from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

LAYER = "*"   # stands for the layer's own name at the start of a parameter or module name


@dataclass(frozen=True)
class Anchor:
    """One op the plan relies on. ``kind`` and ``params`` are compared; ``op`` and ``module`` (the aten
    op and the module that called it) only name it in messages."""

    kind: str                                       # an OpKind value
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) of each parameter it reads
    op: str = ""                                    # e.g. "linear"
    module: str = ""                                # e.g. "*.self_attn.q_proj"

    @property
    def key(self) -> tuple:
        return self.kind, self.params

    def describe(self, layer: str) -> str:
        where = _absolute(self.module, layer) or "the model's top level"
        params = ", ".join(f"{_absolute(p, layer)} {list(s)}" for p, s in self.params)
        return f"{self.op or self.kind} in {where}" + (f" reading {params}" if params else "")


# A run of layers outside the repeated block smaller than this is no ZeRO unit of its own: its
# all-gather and reduce-scatter would be latency for a few MB (torch's FSDP size-based wrapping policy
# has the same default, ``min_num_params=1e8``); at real vocabularies an embedding or head holds more
# (Llama-3-8B's 525 M), keeps its own unit and is not held gathered through the step.
MIN_UNIT_PARAMS = 100_000_000


@dataclass(frozen=True)
class ShardUnits:
    """A chunk's ZeRO-2/3 units (:meth:`ModelStructure.shard_units`), each a tuple of layer indices, in
    the order of their first layer."""

    units: tuple[tuple[int, ...], ...]
    root: tuple[int, ...] | None      # the small runs outside the block: left to the chunk's root unit
    kept: tuple[tuple[int, ...], ...]  # gathered from forward to backward under ZeRO-3 (root included)


@dataclass(frozen=True)
class ModelStructure:
    """The layers in order, each with its anchors (stored once per distinct layer body)."""

    layers: tuple[tuple[str, int], ...]            # (layer name, index into ``bodies``)
    bodies: tuple[tuple[Anchor, ...], ...]

    @cached_property
    def fingerprint(self) -> str:
        """16 hex digits of a SHA-256 over the layer names and their anchors' kinds and parameters."""
        h = hashlib.sha256()
        for name, body in self.layers:
            h.update(f"{name}{{".encode())
            for anchor in self.bodies[body]:
                h.update(f"{anchor.kind}{list(anchor.params)};".encode())
            h.update(b"}")
        return h.hexdigest()[:16]

    def anchors(self, layer: int) -> tuple[Anchor, ...]:
        return self.bodies[self.layers[layer][1]]

    @cached_property
    def repeated(self) -> tuple[bool, ...]:
        """Per layer: whether its body is the model's repeated block (shared with another layer)."""
        count = collections.Counter(body for _, body in self.layers)
        return tuple(count[body] > 1 for _, body in self.layers)

    @cached_property
    def _layer_numel(self) -> tuple[int, ...]:
        """Per layer: elements of the parameters its anchors read (each name once)."""
        out = []
        for _, body in self.layers:
            shapes = {p: shape for a in self.bodies[body] for p, shape in a.params}
            out.append(sum(math.prod(shape) for shape in shapes.values()))
        return tuple(out)

    @cached_property
    def in_root(self) -> tuple[bool, ...]:
        """Per layer: whether ZeRO-2/3 leaves it to its chunk's root unit: a layer outside the repeated
        block whose run of such layers (in the whole model, so a chunk's cut does not change it) holds
        fewer than MIN_UNIT_PARAMS parameters."""
        out = [False] * len(self.layers)
        i = 0
        while i < len(self.layers):
            j = i
            while j < len(self.layers) and not self.repeated[j]:
                j += 1
            if j > i and sum(self._layer_numel[i:j]) < MIN_UNIT_PARAMS:
                out[i:j] = [True] * (j - i)
            i = max(j, i + 1)
        return tuple(out)

    def shard_units(self, indices: Sequence[int], holds: Callable[[int], bool]) -> ShardUnits:
        """The ZeRO-2/3 (FSDP2) units of a run of layers ``indices`` (a chunk), as ``fully_shard`` wraps
        them: each repeated block that holds parameters alone, each run of the other layers (embedding;
        final norm and head) together, as FSDP users wrap the block class and leave the rest to one
        unit. One unit is one all-gather and one reduce-scatter, a launch that a unit of few parameters
        cannot hide: the runs outside the block holding fewer than MIN_UNIT_PARAMS (:attr:`in_root`)
        are one unit together, the chunk's root (FSDP2's size-based wrapping does the same). Layers that
        hold no parameter (``holds``) are in no unit and do not break a run. Each layer's unit depends
        only on the layers before it in ``indices``, so the units of a prefix are those of the whole
        cut at its end. The runtime wraps by them and the cost model counts by them."""
        indices = list(indices)
        units: list[list[int]] = []
        root: list[int] | None = None
        open_run = False
        for i in indices:
            if not holds(i):
                continue
            if self.in_root[i]:
                if root is None:
                    root = []
                    units.append(root)
                root.append(i)
            elif self.repeated[i]:
                units.append([i])
                open_run = False
            elif open_run:
                units[-1].append(i)
            else:
                units.append([i])
                open_run = True
        whole = tuple(tuple(u) for u in units)
        root_unit = tuple(root) if root else None
        # kept gathered from forward to backward: the root (as FSDP2 keeps its root's parameters), and
        # the last unit when the chunk ends the model (final norm and head, whose backward follows their
        # forward at once; torchtitan wraps them so too)
        ends = bool(indices) and indices[-1] == len(self.layers) - 1
        last = max(whole, key=max) if ends and whole else None
        kept = tuple(u for u in whole if u == root_unit or u == last)
        return ShardUnits(whole, root_unit, kept)

    # --- JSON (the plan file's ``structure``: docs/plan-format.md) ---------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"layers": [[name, body] for name, body in self.layers],
                "bodies": [[[a.kind, a.op, a.module, [[p, list(s)] for p, s in a.params]] for a in body]
                           for body in self.bodies]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelStructure":
        """Strict: a malformed value raises ValueError naming it (autopar/plan/io.py turns it into PlanFormatError)."""
        if not isinstance(data, Mapping) or set(data) != {"layers", "bodies"}:
            raise ValueError("structure must be an object with exactly 'layers' and 'bodies'")
        bodies = tuple(tuple(_anchor(a, f"structure.bodies[{b}][{i}]") for i, a in enumerate(_list(body, b)))
                       for b, body in enumerate(_list(data["bodies"], "structure.bodies")))
        layers = []
        for i, entry in enumerate(_list(data["layers"], "structure.layers")):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and type(entry[1]) is int and 0 <= entry[1] < len(bodies)):
                raise ValueError(f"structure.layers[{i}] = {entry!r} must be [layer name, index of a body]")
            layers.append((entry[0], entry[1]))
        return cls(tuple(layers), bodies)


def first_difference(planned: ModelStructure, running: ModelStructure) -> str | None:
    """The first layer, op or parameter where ``running`` (the model here) differs from ``planned``
    (the plan's), in words; None when they agree."""
    names_p = [name for name, _ in planned.layers]
    names_r = [name for name, _ in running.layers]
    for i in range(max(len(names_p), len(names_r))):
        if i >= len(names_p):
            return f"the model here has a layer {names_r[i]} after the plan's last layer {names_p[-1]}"
        if i >= len(names_r):
            return f"the plan's layer {names_p[i]} is missing here (the model here ends at {names_r[-1]})"
        if names_p[i] != names_r[i]:
            return f"layer {i} is {names_r[i]} here but {names_p[i]} in the plan"
        name, a, b = names_p[i], planned.anchors(i), running.anchors(i)
        for k in range(max(len(a), len(b))):
            if k >= len(a):
                return f"layer {name}: op {b[k].describe(name)} here is not in the plan"
            if k >= len(b):
                return f"layer {name}: the plan's op {a[k].describe(name)} is missing here"
            if a[k].key != b[k].key:
                return _op_difference(name, a[k], b[k])
    return None


def _op_difference(layer: str, planned: Anchor, running: Anchor) -> str:
    mine = dict(running.params)
    for p, shape in planned.params:
        if p not in mine:
            return f"layer {layer}: the plan's parameter {_absolute(p, layer)} {list(shape)} is not read here"
        if tuple(mine[p]) != tuple(shape):
            return (f"parameter {_absolute(p, layer)} is {list(mine[p])} here but {list(shape)} in the plan "
                    "(another model size?)")
    return f"layer {layer}: op {running.describe(layer)} here, {planned.describe(layer)} in the plan"


def relative_name(name: str, layer: str) -> str:
    """``name`` (a module's or parameter's path) relative to ``layer``'s module: ``*`` for the module itself."""
    module = layer_module(layer)
    if name == module:
        return LAYER
    return LAYER + name[len(module):] if name.startswith(module + ".") else name


def layer_module(layer: str) -> str:
    """The module path a layer runs: its name without the ``#k`` a second, third... call of one module adds
    (capture/layers.py ``unique_names``), so that a block called twice names its ops and parameters as once."""
    base, sep, visit = layer.rpartition("#")
    return base if sep and visit.isdigit() else layer


def _absolute(name: str, layer: str) -> str:
    return layer_module(layer) + name[len(LAYER):] if name == LAYER or name.startswith(LAYER + ".") else name


def _list(value: Any, where: Any) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list")
    return value


def _anchor(value: Any, where: str) -> Anchor:
    ok = (isinstance(value, list) and len(value) == 4 and all(isinstance(v, str) for v in value[:3])
          and isinstance(value[3], list)
          and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
                  and all(type(d) is int and d >= 0 for d in p[1]) for p in value[3]))
    if not ok:
        raise ValueError(f"{where} = {value!r} must be [kind, op, module, [[parameter, shape], ...]]")
    return Anchor(kind=value[0], op=value[1], module=value[2], params=tuple((p, tuple(s)) for p, s in value[3]))
