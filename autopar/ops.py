"""The op table: what autopar knows of an ATen op by its name, for capture, solver, lowering and context parallelism.

:func:`base_name` is the one way to name an op: ``aten.sum.dim_IntList``, the ``OpOverload`` itself,
``aten::sum``, ``torch.ops.aten.sum`` and ``<built-in function sum>`` are all ``sum`` (an in-place
``add_`` is ``add``). Every set below holds such base names:

- the cost classes capture gives ops (capture/rules.py's ``op_kind``): :data:`MATMULS`,
  :data:`CONVOLUTIONS`, :data:`ATTENTIONS`, :data:`NORMS`, :data:`SOFTMAXES`, :data:`DROPOUTS`,
  :data:`EMBEDDINGS`, :data:`LOSSES`, :data:`VIEWS`, :data:`CREATION`, :data:`REDUCTIONS`;
- norms by what they normalise: :data:`LAYER_NORMS` (the last dims of each row, :data:`RMS_NORMS`
  among them), :data:`CHANNEL_NORMS` (per channel, dim 1: :data:`BATCH_NORMS` over the batch too,
  whose parameters and running statistics run along the channels);
- losses: :data:`CLASS_LOSSES` (class scores along dim 1, or dim 0 unbatched, against class ids),
  :data:`VOCAB_LOSSES` (those the vocabulary-parallel lowering runs, with what its one all-reduce
  carries: the solver offers the ``vocab`` strategy for exactly these), :data:`ROW_LOSSES` (those
  whose rows a rank can hold part of: a local sum, then an all-reduce of the sum and the count);
- shapes: :data:`RESHAPES`, :data:`SHAPED_VIEWS` and :data:`SHAPE_ARG` (the output-shape argument
  the lowering rewrites to a rank's local sizes), :data:`LIKE_CREATION`, :data:`SPLITS`;
- reductions a rank may take over its shard and all-reduce: :data:`LINEAR_REDUCTIONS`;
- element-wise: :data:`BROADCASTING` (capture's dims maps), :data:`ELEMENTWISE` (the cost class) and
  what autograd saves of each (:data:`SAVES_OUTPUT`, :data:`SAVES_INPUT`, :data:`SAVES_NOTHING`),
  :data:`CASTS`; context parallelism's :data:`LINEAR_OPS` (a partial input gives a partial output),
  :data:`PRODUCTS` and :data:`SORTS`;
- what no rank runs, or runs whole: :data:`SKIPPED_TARGETS`, :data:`CONTEXT_HOPS`.

A leaf: imports nothing of autopar and no torch, so the runtime library and standalone folders can
read it too. A per-op rule that needs more than a name (a dims map, a FLOP count, a saved tensor) stays
with its module, keyed by these sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


def base_name(target: object) -> str:
    """The base name of an op: ``aten.linear.default`` (or the ``OpOverload``, ``aten::linear``,
    ``aten.linear``) -> ``linear``; ``transformers.grouped_mm_fallback.default`` -> ``grouped_mm_fallback``;
    ``operator.getitem`` (or its text ``<built-in function getitem>``) -> ``getitem``; a higher-order op by
    its name; an in-place ``relu_`` -> ``relu`` (a private ``_softmax`` keeps its underscore)."""
    name = _name(target)
    return name.rstrip("_") if _inplace(name) else name


def is_inplace(target: object) -> bool:
    """Whether ``target`` is an in-place op (``add_``, ``fill_``; not a private ``_softmax``)."""
    return _inplace(_name(target))


def _name(target: object) -> str:
    """The op's name as it is written, an in-place op's trailing underscore kept."""
    schema = getattr(target, "_schema", None)
    if schema is not None:                      # an OpOverload: its schema's "ns::name"
        return _from_text(str(schema.name))
    if isinstance(target, str):
        return _from_text(target)
    return getattr(target, "__name__", None) or _from_text(str(target))   # a Python function, a HOP


def _inplace(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _from_text(text: str) -> str:
    if text.startswith("<") and text.endswith(">"):   # "<built-in function getitem>", "<function f at 0x..>"
        words = text[1:-1].split()
        return words[2] if len(words) > 2 and words[1] == "function" else words[-1]
    if "::" in text:                                  # "aten::sum.dim_IntList"
        return text.split("::")[-1].split(".")[0]
    parts = text.split(".")
    if len(parts) >= 3:                               # "aten.sum.dim_IntList", "torch.ops.aten.sum.default"
        return parts[-2]
    return parts[-1]                                  # "aten.sum" (a packet), "sum"


SKIPPED_TARGETS = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                             "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"})
"""The exported graph's metadata asserts (``str(node.target)``), which no rank runs."""
CONTEXT_HOPS = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})
"""Higher-order ops of a ``torch.no_grad()`` or autocast region: run whole, as the context around their body."""

# ------------------------------------------------------------------------------ cost classes

MATMULS = _names("linear matmul mm bmm addmm baddbmm addbmm einsum addmv mv dot _scaled_mm "
                 "_grouped_mm grouped_mm grouped_mm_fallback")
GROUPED_MM = _names("_grouped_mm grouped_mm grouped_mm_fallback")
"""Grouped GEMMs (``torch.nn.functional.grouped_mm`` and transformers' fallback custom op): rows of
``x`` [S, k] sorted by group, each group's rows times its own weight ``w[g]`` [k, n]."""
BIAS_MATMULS = _names("addmm baddbmm addbmm addmv")
"""``out = bias + a @ b``: the matrices are arguments 1 and 2."""
CONVOLUTIONS = _names("conv1d conv2d conv3d convolution _convolution conv_transpose1d conv_transpose2d "
                      "conv_transpose3d")
FORWARD_CONVOLUTIONS = _names("conv1d conv2d conv3d convolution _convolution")
"""The convolutions whose weight is ``[out channels, in channels, kernel...]`` (no transposed ones)."""
SDPA = _names("scaled_dot_product_attention _scaled_dot_product_flash_attention "
              "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention "
              "_scaled_dot_product_flash_attention_for_cpu")
"""Scaled dot-product attention: ``(q, k, v, mask...)``."""
ATTENTIONS = SDPA | {"flex_attention"}
SOFTMAXES = _names("softmax _softmax log_softmax _log_softmax _safe_softmax")
VOLATILE = _names("contiguous clone expand alias detach lift_fresh_copy")
"""Ops whose presence depends on the export, not the model (plan/sharding.py): layout copies a kernel's strides
add or drop, the broadcast a batch of 1 makes a no-op, the identity export uses for a no-op view, the detach
export keeps only where its input requires a gradient (a rank's program may hold frozen stand-ins), the copy
of a tensor constant the code makes (torch.tensor(...)), there or not by how a program holds constants.
Dropout (OpKind.DROPOUT) and state updates (is_volatile), gone in eval mode, are volatile too."""
DROPOUTS = _names("dropout native_dropout feature_dropout alpha_dropout feature_alpha_dropout")
EMBEDDINGS = _names("embedding embedding_bag")

# ------------------------------------------------------------------------------------- norms

RMS_NORMS = _names("rms_norm _fused_rms_norm")
LAYER_NORMS = _names("layer_norm native_layer_norm") | RMS_NORMS
"""Norms over each row's last dims (``normalized_shape``)."""
BATCH_NORMS = _names("batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional "
                     "_native_batch_norm_legit_no_training")
"""Norms per channel (dim 1) over every other dim, the batch's included."""
GROUP_NORMS = _names("group_norm native_group_norm")
CHANNEL_NORMS = BATCH_NORMS | GROUP_NORMS | {"instance_norm"}
"""Norms whose weight, bias and running statistics run along the channels (dim 1)."""
NORMS = LAYER_NORMS | CHANNEL_NORMS

# ------------------------------------------------------------------------------------ losses


@dataclass(frozen=True)
class VocabLoss:
    """How the vocabulary-parallel lowering runs a class loss whose class dim is split over the ranks
    (runtime/shard_ops.py): ``form`` "cross_entropy" (``vocab_cross_entropy``: every rank's row max,
    exponential sum and target logit, each rank in a slot of its own) or "nll" (``vocab_nll``: the
    target's log-probability); ``per_row`` values per row its one all-reduce carries, ``slots`` whether
    each rank fills a slot of its own (the all-reduce is ``t`` times as long)."""

    form: str
    per_row: int
    slots: bool

    def all_reduce_numel(self, rows: int, t: int) -> int:
        """Elements of the one all-reduce over ``t`` ranks for ``rows`` rows."""
        return self.per_row * rows * (t if self.slots else 1)


_NLL = VocabLoss("nll", 1, False)
VOCAB_LOSSES: Mapping[str, VocabLoss] = MappingProxyType({
    "cross_entropy_loss": VocabLoss("cross_entropy", 3, True),   # label smoothing adds a fourth value, left out
    "nll_loss": _NLL, "nll_loss_nd": _NLL, "nll_loss2d": _NLL})
"""The class losses of one output and arguments ``(self, target, weight, reduction, ignore_index...)``."""


def is_cross_entropy(target: object) -> bool:
    """A softmax cross entropy: a class loss of scores (log_softmax and nll_loss in one op), which
    programs run as several passes over its scores (cost_model/compute.py's ``loss_bytes``)."""
    loss = VOCAB_LOSSES.get(base_name(target))
    return loss is not None and loss.form == "cross_entropy"


CLASS_LOSSES = frozenset(VOCAB_LOSSES) | {"nll_loss_forward", "nll_loss2d_forward"}
"""Class scores along dim 1 (dim 0 unbatched) against class ids (the ``_forward`` ones return the loss
and the total weight: no vocabulary-parallel form)."""
ELEMENT_LOSSES = _names("mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy "
                        "binary_cross_entropy_with_logits kl_div soft_margin_loss")
"""Losses of element-wise terms: input and target broadcast together."""
ROW_LOSSES = frozenset(VOCAB_LOSSES) | ELEMENT_LOSSES
"""Losses of one output a rank can take over its rows at ``reduction=sum`` (then an all-reduce)."""
LOSSES = CLASS_LOSSES | ELEMENT_LOSSES

# ----------------------------------------------------------------------------- views, shapes

RESHAPES = _names("view _unsafe_view reshape _reshape_alias flatten unflatten view_as squeeze unsqueeze")
"""Views that regroup dims without moving data (mapped by runs of equal products)."""
SHAPED_VIEWS = _names("view _unsafe_view reshape")
"""Views whose argument 1 is the output shape."""
SIZED_SPLITS = _names("split split_with_sizes")
"""Splits whose argument 1 is the pieces' size (or sizes)."""
SPLITS = SIZED_SPLITS | {"chunk", "tensor_split"}
VIEWS = RESHAPES | (SPLITS - {"tensor_split"}) | _names(
    "transpose permute expand expand_as slice select t alias unbind narrow as_strided getitem movedim detach "
    "diagonal unfold numpy_T mT")
"""Ops that alias their input and move no data."""
LIKE_CREATION = _names("zeros_like ones_like empty_like full_like rand_like randn_like")
CREATION = LIKE_CREATION | _names(
    "ones zeros full arange empty scalar_tensor tensor rand randn randint linspace eye new_ones new_zeros "
    "new_full new_empty empty_strided _to_copy_empty lift_fresh_copy")
SHAPE_ARG: Mapping[str, int] = MappingProxyType({
    **dict.fromkeys(SHAPED_VIEWS | _names("expand new_zeros new_ones new_empty new_full"), 1),
    **dict.fromkeys(_names("zeros ones empty full rand randn empty_strided"), 0)})
"""Position of the output-shape argument of the views and creation ops that take one."""

# -------------------------------------------------------------------------------- reductions

REDUCTIONS = _names("sum mean amax amin max min var std var_mean std_mean norm logsumexp argmax argmin "
                    "cumsum cumprod any all prod linalg_vector_norm")
LINEAR_REDUCTIONS = _names("sum amax amin max min")
"""Reductions a rank may take over its shard and all-reduce. Not mean: DTensor gives it a P(avg) output
whose backward meets P(sum) gradients, which it cannot redistribute ("from one partial type to another is
unsupported"), so the runtime could not run a plan that used it."""

# ------------------------------------------------------------------------------ element-wise

BROADCASTING = _names(
    "add sub rsub mul div neg relu gelu silu sigmoid tanh exp log log1p rsqrt sqrt pow where masked_fill "
    "eq ne lt le gt ge logical_not logical_and logical_or logical_xor bitwise_not bitwise_and bitwise_or "
    "maximum minimum clamp clamp_min clamp_max abs sign erf sin cos reciprocal square softplus mish "
    "leaky_relu hardtanh hardswish hardsigmoid elu relu6 atan isnan isinf clone contiguous to _to_copy copy "
    "alias detach dropout native_dropout feature_dropout alpha_dropout feature_alpha_dropout lift_fresh_copy "
    "fill zero expand expand_as floor ceil round trunc frac exp2 expm1 sinh cosh tan asin acos "
    "logit xlogy float_power fmod remainder lerp addcmul addcdiv nan_to_num")
"""Ops whose output broadcasts from each tensor argument: element-wise maths, comparisons, casts and copies,
dropout, ``expand``."""

SAVES_OUTPUT = _names("relu sigmoid tanh exp rsqrt sqrt elu hardsigmoid reciprocal")
"""Element-wise ops whose backward needs their output (not their input)."""
SAVES_INPUT = _names("gelu silu mish leaky_relu hardtanh hardswish softplus log log1p sin cos pow abs sign erf atan "
                     "square clamp clamp_min clamp_max")
"""Element-wise ops whose backward needs their first input."""
SAVES_NOTHING = _names("add sub neg clone contiguous copy _to_copy to type_as cat stack pad constant_pad_nd repeat "
                       "index_select_backward flip roll tril triu zeros_like ones_like sum mean cumsum "
                       "adaptive_avg_pool2d avg_pool2d avg_pool1d mean_dim")
"""Ops whose backward needs nothing of the forward (shape-only, or linear in their input)."""
ELEMENTWISE = (SAVES_OUTPUT | SAVES_INPUT | SAVES_NOTHING | _names(
    "mul div masked_fill where eq ne lt le gt ge logical_not logical_and logical_or bitwise_not bitwise_and isnan "
    "isinf maximum minimum")) - (MATMULS | CONVOLUTIONS | ATTENTIONS | NORMS | SOFTMAXES | DROPOUTS | EMBEDDINGS
                                 | LOSSES | VIEWS | CREATION | REDUCTIONS)
"""The element-wise cost class: the named element-wise ops (and the copies, concatenations and pads of
:data:`SAVES_NOTHING`) that no other class takes."""

CASTS = _names("to _to_copy type_as clone contiguous copy alias lift_fresh_copy")
"""Ops that pass their input's values on, but for the dtype: copies and casts."""
LINEAR_OPS = _names("add sub neg view _unsafe_view reshape flatten unflatten squeeze unsqueeze alias clone contiguous "
                    "to _to_copy detach permute transpose t expand select slice sum mean mul div linear mm matmul")
"""Ops linear (affine) in their floating inputs, so they commute with a sum or mean over ranks (a partial
input gives a partial output); :data:`PRODUCTS` in one such input at a time, ``div`` in its numerator only."""
PRODUCTS = _names("mul linear mm matmul")
SORTS = _names("topk sort argsort")

FP8_ALIGN = 16
"""An fp8 linear layer's in- and out-features are multiples of this (the fp8 GEMMs' alignment: torchao's
``convert_to_float8_training`` and torchtitan's float8 converter skip any other linear)."""


def runs_in_fp8(op: object, module_type: str, in_features: int, out_features: int) -> bool:
    """Whether an fp8 program (``Precision(compute="fp8")``) runs this op on the fp8 tensor cores: the
    ``linear`` of an ``nn.Linear`` whose features are multiples of :data:`FP8_ALIGN`. The one rule the cost
    model prices (cost_model/low_precision.py) and the runtime applies (runtime/fp8.py)."""
    return (base_name(op) == "linear" and module_type == "Linear" and in_features % FP8_ALIGN == 0
            and out_features % FP8_ALIGN == 0)
