"""OpGraph: the captured model, the only thing the cost model and solver read of it.

Sizes are recorded at the batch size of the example inputs (``OpGraph.batch_size``);
every op says whether it scales with the batch (``batch_dependent``), so costs at
another micro-batch size are a linear rescaling, not a re-capture. FLOPs are
floating-point operations (a multiply-add is 2), bytes are bytes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Iterator, Mapping

from ..plan.loss import LossSource
from ..plan.sharding import OpId

if TYPE_CHECKING:
    from ..plan.structure import ModelStructure

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
                "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``str(torch.float32).split('.')[-1]``."""
    return _DTYPE_BYTES.get(dtype, 4)


class OpKind(str, enum.Enum):
    """Cost class of an op: decides which efficiency model times it."""

    MATMUL = "matmul"          # linear, mm, bmm, matmul, einsum
    ATTENTION = "attention"    # fused scaled-dot-product attention
    CONV = "conv"
    NORM = "norm"              # layer/rms/batch/group norm
    SOFTMAX = "softmax"
    DROPOUT = "dropout"
    EMBEDDING = "embedding"
    LOSS = "loss"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    VIEW = "view"              # aliases its input; moves no data
    CREATION = "creation"      # ones, arange, full: no tensor input
    OTHER = "other"


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor (dtype as a short name, e.g. "float32")."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@dataclass(frozen=True)
class SavedTensor:
    """A tensor autograd keeps from forward to backward.

    ``root`` names the storage: the producing node (views resolved to their base),
    or ``"<node>:<what>"`` for a tensor an op saves internally (dropout mask, norm
    statistics, attention log-sum-exp).
    """

    root: str
    numel: int
    dtype: str
    batch_dependent: bool

    def nbytes(self, float_bytes: int | None = None, model_dtype: str | None = None) -> int:
        """Bytes; floating tensors are counted at ``float_bytes`` per element when given (the
        training precision), other dtypes (masks, indices) at their own size. With ``model_dtype``
        (``OpGraph.float_dtype``) only tensors of that dtype take the training precision: one the
        model casts to another float dtype on purpose (an RMSNorm's float32 copy of a bf16 input)
        keeps its own size."""
        at_training = self.dtype in FLOAT_DTYPES and (model_dtype is None or self.dtype == model_dtype)
        per = float_bytes if (float_bytes is not None and at_training) else dtype_bytes(self.dtype)
        return self.numel * per


@dataclass(frozen=True)
class Gemm:
    """A matrix multiply as ``batch`` independent (m x k) @ (k x n) products.

    ``scaled`` names the dimension that grows with the micro-batch: "batch" or "m" (or
    "" when none does, e.g. a weight-only product). ``density`` is the fraction of the ``m x n``
    products the kernel computes: 1 for a dense product; for attention under ``is_causal`` the
    share of (query, key) pairs the causal mask keeps, since fused attention kernels skip the
    masked tiles (FlashAttention, and the CPU flash kernel); an explicit mask tensor is read
    whole, so it keeps 1. FLOP counts stay dense (Megatron's and PaLM's accounting); only the
    time the kernel takes scales by ``density``.
    """

    batch: int
    m: int
    n: int
    k: int
    scaled: str = "m"
    density: float = 1.0


@dataclass(frozen=True)
class OpNode:
    """One op of the captured forward graph, with its forward and backward costs."""

    name: str
    target: str                       # e.g. "aten.linear.default"
    kind: OpKind
    inputs: tuple[str, ...]           # producer node names of activation inputs (graph inputs included)
    params: tuple[str, ...]           # fully qualified names of parameters it reads
    outputs: tuple[TensorMeta, ...]
    flops_fwd: float
    flops_bwd: float
    bytes_fwd: float                  # bytes read + written in forward (0 for views)
    requires_grad: bool
    batch_dependent: bool             # scales linearly with the batch size
    saved: tuple[SavedTensor, ...]    # what autograd keeps for this op's backward
    module_path: str                  # innermost module ("" for the root)
    module_type: str
    layer: int                        # index into OpGraph.layers
    gemm: Gemm | None = None
    attention_core: bool = False      # in an attention core (capture/layers.py): selective recompute reruns it
    # Per activation input (``inputs`` order): for each output dim, the input dim it comes from, -1 for
    # none (new, broadcast, merged-inner or contracted dims); ``()`` when capture does not know the op.
    dims: tuple[tuple[int, ...], ...] = ()
    reduced: tuple[int, ...] = ()     # dims of the first input the op reduces or normalises over
    # A view of parameters (``W.t()`` read by a matmul): per parameter (``params`` order), for each output
    # dim, the parameter dim it comes from (-1 for none); ``()`` for any other op.
    param_dims: tuple[tuple[int, ...], ...] = ()

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


@dataclass(frozen=True)
class Layer:
    """A contiguous run of ops that pipeline stages are cut between.

    Repeated blocks (a transformer's decoder layers) share a ``signature``; the
    solver and cost model work once per signature.
    """

    index: int
    name: str                         # module path, e.g. "blocks.3" or "embed"
    signature: str
    nodes: tuple[int, ...]            # indices into OpGraph.nodes
    params: tuple[str, ...]           # parameters first used in this layer (each counted once)
    shared_params: tuple[str, ...]    # parameters used here but first used by an earlier layer (tied)
    param_numel: int
    inputs: tuple[str, ...]           # nodes from earlier layers (or graph inputs) this layer reads
    is_block: bool                    # part of a repeated-block family


@dataclass(frozen=True)
class GraphInput:
    name: str
    meta: TensorMeta
    batch_dependent: bool


@dataclass(frozen=True)
class MoERegion:
    """One mixture-of-experts experts call found by capture (rules in :mod:`autopar.capture.moe`).

    The experts compute, for ``T`` tokens ``x_t`` each routed to ``k`` of ``E`` experts,
    ``out_t = sum_j w_tj * D_e (act(G_e x_t) * (U_e x_t))`` with ``e`` the j-th expert id of token
    t, ``G_e``/``U_e`` the gate/up rows of ``gate_up[e]`` and ``D_e = down[e]``. The nodes of
    the region carry the FLOPs of that routed work only (``T*k`` rows per GEMM; fewer when a
    capacity drops some), whatever the implementation computes.
    """

    layer: int                   # index of the OpGraph layer holding it
    module: str                  # module path of the experts module, e.g. "model.layers.0.mlp.experts"
    nodes: tuple[str, ...]       # graph nodes computed inside the experts module (what expert parallelism replaces)
    hidden_input: str            # value (node or graph input) of the tokens entering the experts, [T, h]
    index_input: str             # top-k expert ids, [T, k] integer
    weight_input: str            # top-k routing weights, [T, k] float
    output: str                  # node of the experts' combined output, [T, h]
    gate_up: str                 # parameter, stacked [E, 2f, h] (gate rows first, then up)
    down: str                    # parameter, stacked [E, h, f]
    activation: str              # what act(gate) * up uses: a Hugging Face hidden_act name ("silu", "gelu", ...)
    num_experts: int             # E
    top_k: int                   # k
    tokens: int                  # T at the captured batch (batch * seq)
    hidden: int                  # h
    ffn: int                     # f, each expert's intermediate size
    router: str | None           # the router's weight parameter, when found
    capacity: int | None = None  # slots per expert when the experts drop assignments beyond them (a
                                 # capacity buffer of E x C < E x T rows), None when nothing is dropped


@dataclass(frozen=True)
class OpGraph:
    """The captured model. Build with :func:`autopar.capture.capture`."""

    model_name: str
    nodes: tuple[OpNode, ...]
    layers: tuple[Layer, ...]
    params: Mapping[str, TensorMeta]      # every trainable parameter (tied ones once)
    buffers: Mapping[str, TensorMeta]
    inputs: tuple[GraphInput, ...]
    batch_size: int
    structure: "ModelStructure"           # what a plan relies on (capture/structure.py)
    loss: LossSource                      # how the loss the graph ends in was made (loss.py)
    op_ids: tuple[OpId | None, ...]       # per node, its structural identity (None: volatile; structure.py)
    warnings: tuple[str, ...] = field(default=())
    moe: tuple[MoERegion, ...] = field(default=())   # mixture-of-experts regions, in graph order
    saves: str = "autograd"               # what ``saved`` holds: autograd's saves, or a compiled program's cut
    replicated: frozenset[str] = field(default=frozenset())   # read the batch and buffers alone (replicated.py)
    derived: dict[str, "OpGraph"] = field(default_factory=dict, init=False, repr=False, compare=False)
    """An explicit cache of the graphs computed from this one (fusion.for_kernels' compiled form); a copy
    made with dataclasses.replace starts with an empty one."""

    @cached_property
    def node_index(self) -> Mapping[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    @property
    def fingerprint(self) -> str:
        """The model's identity for plans: the same on any device, at any batch size, in train or eval
        mode, and different when a layer, an op the plan relies on or a parameter shape differs."""
        return self.structure.fingerprint

    @cached_property
    def content_hash(self) -> str:
        """16 hex digits of a SHA-256 over every op, the shapes that do not depend on the batch and the
        parameters' names, shapes and dtypes: a key for what was measured of exactly this graph
        (profiler caches), unlike :attr:`fingerprint`, which ignores what plans do not rely on."""
        import hashlib
        h = hashlib.sha256()
        for n in self.nodes:
            shapes = "" if n.batch_dependent else [o.shape for o in n.outputs]
            h.update(f"{n.target}|{shapes}|{n.params};".encode())
        for fqn in sorted(self.params):
            h.update(f"{fqn}:{self.params[fqn].shape}:{self.params[fqn].dtype};".encode())
        return h.hexdigest()[:16]

    def node(self, name: str) -> OpNode:
        return self.nodes[self.node_index[name]]

    @cached_property
    def node_of(self) -> Mapping[OpId, str]:
        """Node name of each op identity (capture/structure.py ``op_ids``)."""
        return {i: n.name for n, i in zip(self.nodes, self.op_ids) if i is not None}

    def op_id(self, name: str) -> OpId | None:
        """The structural identity of node ``name`` (None for a volatile op)."""
        return self.op_ids[self.node_index[name]]

    def layer_nodes(self, layer: Layer) -> Iterator[OpNode]:
        return (self.nodes[i] for i in layer.nodes)

    @cached_property
    def float_dtype(self) -> str:
        """The dtype most parameter elements have (float32 without float parameters): the precision
        the model was captured in, which training replaces by its own (``SavedTensor.nbytes``)."""
        counts: dict[str, int] = {}
        for meta in self.params.values():
            if meta.is_float:
                counts[meta.dtype] = counts.get(meta.dtype, 0) + meta.numel
        return max(sorted(counts), key=counts.__getitem__) if counts else "float32"

    @cached_property
    def fused_attention(self) -> tuple[OpNode, ...]:
        """The fused scaled-dot-product attention ops, in graph order (what ring attention replaces)."""
        return tuple(n for n in self.nodes if n.kind is OpKind.ATTENTION)

    @cached_property
    def unfused_attention(self) -> tuple[OpNode, ...]:
        """The ops of attention cores computed with explicit ops (selective recompute drops them)."""
        return tuple(n for n in self.nodes if n.attention_core and n.kind is not OpKind.ATTENTION)

    @cached_property
    def recomputable(self) -> tuple[bool, ...]:
        """Per layer, whether recomputation applies to it: the repeated blocks (Megatron-LM leaves the
        embedding and the head alone, and counts ``--recompute-num-layers`` in blocks); a model
        without repeated blocks recomputes every layer."""
        blocks = any(layer.is_block for layer in self.layers)
        return tuple(layer.is_block or not blocks for layer in self.layers)

    @cached_property
    def param_numel(self) -> int:
        return sum(t.numel for t in self.params.values())

    @property
    def flops_fwd(self) -> float:
        """Forward FLOPs of one pass over the captured batch."""
        return sum(n.flops_fwd for n in self.nodes)

    @property
    def flops_bwd(self) -> float:
        return sum(n.flops_bwd for n in self.nodes)

    def signature_counts(self) -> dict[str, int]:
        """How many layers share each signature, in order of first appearance."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.signature] = counts.get(layer.signature, 0) + 1
        return counts

    def describe(self) -> str:
        """One line per layer family, e.g. ``96 x blocks.* (1.81 G params)``."""
        lines = [f"{self.model_name}: {len(self.nodes)} ops, {len(self.layers)} layers, "
                 f"{self.param_numel / 1e9:.3f} G params, batch {self.batch_size}"]
        seen: dict[str, list[Layer]] = {}
        for layer in self.layers:
            seen.setdefault(layer.signature, []).append(layer)
        for group in seen.values():
            first = group[0]
            name = first.name if len(group) == 1 else f"{len(group)} x {first.name} .. {group[-1].name}"
            lines.append(f"  {name}: {len(first.nodes)} ops, {first.param_numel / 1e6:.2f} M params each")
        return "\n".join(lines)
