"""Any Hugging Face architecture at a test size: its own config class's defaults, shrunk.

``shrink(config)`` rewrites the size fields transformers' configs use (layers, widths, heads,
key/value heads, feed-forward widths, head dimensions, vocabulary, positions, experts and their
top-k, MLA / LoRA ranks, convolution and state sizes) to small values, in the config and every
sub-config (``text_config``, ``vision_config``, ``encoder``/``decoder``), and cuts per-layer
lists (``layer_types``, ``mlp_only_layers``...) to the new layer count. Only fields the config
has are touched, and only downwards: a default already smaller is kept. Ratios the
architectures check are kept true by construction (heads divide the width, key/value heads
divide the heads, ``head_dim = hidden / heads`` where the config derives it).

Image classifiers get :func:`shrink_images` too (IMAGE pixels a side, stage-wise encoders
consistent).

``build(name)`` finds the architecture's class in transformers' auto registries, builds it from
its shrunk default config with random weights on the CPU (or meta); ``example`` makes its inputs
(``input_ids`` and ``labels``, or ``pixel_values`` and ``labels``) whose loss is
``model(**inputs).loss``. What cannot be built
raises :class:`ShrinkError` naming the architecture and the cause, so a sweep can report it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

LAYERS = 2
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 128
VOCAB = 256
POSITIONS = 128
EXPERTS = 4
TOP_K = 2
SEQ = 16
CLASSES = 3
IMAGE = 64    # pixels a side of an image classifier's inputs: a 32x downsampling encoder ends at 2x2

_KV_FIELDS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_kv_heads_per_layer")
# field -> value; the first group sets layer counts (per-layer lists are cut to them)
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                 "num_encoder_layers", "decoder_layers", "encoder_layers", "num_blocks")
_SIZES: dict[str, int] = {
    **{f: LAYERS for f in _LAYER_FIELDS},
    **{f: HIDDEN for f in ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "embed_dim", "model_dim",
                           "word_embed_proj_dim", "embedding_size", "hidden_dim")},
    **{f: HEADS for f in ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                          "decoder_attention_heads")},
    **{f: KV_HEADS for f in _KV_FIELDS},
    **{f: FFN for f in ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "encoder_ffn_dim",
                        "decoder_ffn_dim", "inner_hidden_size", "mlp_dim", "ffn_config_hidden")},
    **{f: FFN // 2 for f in ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                             "moe_ffn_hidden_size")},
    **{f: HEAD_DIM for f in ("head_dim", "d_kv", "kv_channels", "attention_head_dim", "v_head_dim")},
    **{f: VOCAB for f in ("vocab_size",)},
    **{f: POSITIONS for f in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                              "max_sequence_length", "seq_length")},
    **{f: EXPERTS for f in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")},
    **{f: TOP_K for f in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")},
    **{f: 1 for f in ("n_shared_experts", "num_shared_experts")},
    **{f: 32 for f in ("q_lora_rank",)},
    **{f: 16 for f in ("kv_lora_rank",)},
    **{f: 8 for f in ("qk_rope_head_dim", "qk_nope_head_dim")},
    **{f: 16 for f in ("state_size", "ssm_state_size", "d_state", "conv_kernel", "d_conv")},
    **{f: 16 for f in ("sliding_window", "attention_window", "local_attention")},
    **{f: 8 for f in ("num_buckets", "relative_attention_num_buckets")},
    **{f: 16 for f in ("relative_attention_max_distance",)},
    **{f: HIDDEN for f in ("d_latents",)},                  # Perceiver's latent width
    **{f: LAYERS for f in ("num_self_attends_per_block",)},  # and its latent self-attention layers
    **{f: 8 for f in ("num_filters",)},                     # convolutional audio encoders' first width
}
# per-stage depths of convolutional encoders (each stage doubles the width): one block a stage
_STAGE_DEPTHS = ("depths",)
# per-layer lists and tuples cut to the layer count
_PER_LAYER = ("layer_types", "mlp_only_layers", "block_types", "attn_layer_indices", "attention_layers",
              "layers_block_type", "no_rope_layers", "sliding_window_pattern_layers")


class ShrinkError(ConfigError):
    """An architecture that cannot be built at the test size (the sweep reports the cause)."""


def _is_config(value: Any) -> bool:
    from transformers import PretrainedConfig
    return isinstance(value, PretrainedConfig)


def shrink(config: Any, layers: int = LAYERS) -> Any:
    """``config`` (a transformers PretrainedConfig) with its size fields small (``layers`` layers), in
    place; returned."""
    heads = getattr(config, "num_attention_heads", None)
    # attention without key/value groups stays so: multi-head latent attention projects keys and values
    # for every head while transformers repeats them by heads // num_key_value_heads under tracing
    ungrouped = [f for f in _KV_FIELDS if isinstance(heads, int) and getattr(config, f, None) == heads]
    for name, small in _SIZES.items():
        small = layers if name in _LAYER_FIELDS else small
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > small:
            setattr(config, name, small)
    depth = min((getattr(config, f) for f in _LAYER_FIELDS
                 if isinstance(getattr(config, f, None), int) and not isinstance(getattr(config, f), bool)),
                default=None)
    if depth is not None:
        for name in _PER_LAYER:
            value = getattr(config, name, None)
            if isinstance(value, (list, tuple)) and len(value) > depth:
                setattr(config, name, type(value)(value[:depth]))
    for name in _STAGE_DEPTHS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            setattr(config, name, type(value)(min(d, 1) for d in value))
    heads = getattr(config, "num_attention_heads", None)
    for name in ungrouped:
        setattr(config, name, heads)
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        config.num_key_value_heads = 1
    rope = getattr(config, "qk_rope_head_dim", None)
    if isinstance(rope, int) and hasattr(config, "head_dim"):
        config.head_dim = rope   # multi-head latent attention ropes qk_rope_head_dim dims, its "head_dim"
    head = getattr(config, "head_dim", None) or HEAD_DIM
    if isinstance(getattr(config, "rotary_dim", None), int) and config.rotary_dim > head // 2:
        config.rotary_dim = head // 2
    for name in [n for n in vars(config) if n.endswith("_token_id")]:
        value = getattr(config, name)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, VOCAB - 1)   # embeddings index their padding token
    if isinstance(getattr(config, "first_k_dense_replace", None), int):
        config.first_k_dense_replace = min(config.first_k_dense_replace, 1)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    for name, value in list(vars(config).items()):
        if _is_config(value):
            shrink(value, layers)
    return config


def shrink_images(config: Any, default: Any) -> Any:
    """``config`` (``default``: the same config class's defaults), through :func:`shrink` already,
    made an image classifier's test size, in place, in it and every sub-config: images IMAGE pixels
    a side; a stage-wise encoder (a ``depths`` list: Swin, ConvNeXt, ResNet...) keeps its stage
    count, which :func:`shrink` took for a layer count (its per-stage lists are read stage by stage;
    each stage is one block deep already), the width derived from it (Swin's ``hidden_size``:
    ``embed_dim`` doubled at each stage) and attention windows no wider than its last stage; per-stage
    head counts are cut to divide their stage's width (``hidden_sizes[i]``, or ``embed_dim * 2**i``),
    which a shrunk ``embed_dim`` need not."""
    size = getattr(config, "image_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > IMAGE:
        config.image_size = IMAGE
    elif _ints(size):
        config.image_size = type(size)(min(d, IMAGE) for d in size)
    depths = getattr(default, "depths", None)
    if _ints(depths):
        stages = len(depths)
        for name in _LAYER_FIELDS:
            if getattr(default, name, None) == stages:
                setattr(config, name, stages)
        embed = getattr(default, "embed_dim", None)
        if isinstance(embed, int) and getattr(default, "hidden_size", None) == embed * 2 ** (stages - 1):
            config.hidden_size = config.embed_dim * 2 ** (stages - 1)
        patch, window = getattr(config, "patch_size", None), getattr(config, "window_size", None)
        if isinstance(patch, int) and isinstance(window, int) and not isinstance(window, bool):
            # windowed attention: a window no wider than the last stage's tokens (Swin builds its relative
            # position table at the configured window and attends within the stage's whole width when smaller)
            config.window_size = max(1, min(window, IMAGE // patch // 2 ** (stages - 1)))
    embed = getattr(config, "embed_dim", None)
    widths = getattr(config, "hidden_sizes", None)
    for name in ("num_heads", "num_attention_heads"):
        heads = getattr(config, name, None)
        if not _ints(heads):
            continue
        stage_widths = (list(widths) if _ints(widths) and len(widths) == len(heads)
                        else [embed * 2 ** i for i in range(len(heads))] if isinstance(embed, int) else None)
        if stage_widths:
            setattr(config, name, type(heads)(math.gcd(h, w) for h, w in zip(heads, stage_widths)))
    for name, value in list(vars(config).items()):
        if _is_config(value) and _is_config(getattr(default, name, None)):
            shrink_images(value, getattr(default, name))
    return config


def _ints(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


@dataclass(frozen=True)
class Architecture:
    """One entry of transformers' auto registries: the model class and the task its loss is for."""

    name: str         # the model class's name, e.g. "LlamaForCausalLM"
    model_type: str   # the config's model_type, e.g. "llama"
    task: str         # "causal-lm", "masked-lm", "seq2seq", "classification" or "image-classification"


REGISTRIES = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
              "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
              "classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
              "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}


def architectures() -> list[Architecture]:
    """Every model class of the registries, once (the first task that lists it), in registry order."""
    from transformers.models.auto import modeling_auto
    seen, out = set(), []
    for task, registry in REGISTRIES.items():
        for model_type, names in getattr(modeling_auto, registry).items():
            for name in (names,) if isinstance(names, str) else tuple(names):
                if name not in seen:
                    seen.add(name)
                    out.append(Architecture(name, model_type, task))
    return out


def _config(arch: Architecture, layers: int = LAYERS) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config = CONFIG_MAPPING[arch.model_type]()
    shrink(config, layers)
    if arch.task == "image-classification":
        shrink_images(config, CONFIG_MAPPING[arch.model_type]())
        config.num_labels = CLASSES
    if arch.task == "classification":
        config.num_labels = CLASSES
        for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
            if getattr(c, "pad_token_id", None) is None:
                c.pad_token_id = 0   # batches of more than one sequence need it to find each last token
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0   # labels shift right onto it
    return config


_DROPOUTS = ("dropout", "layerdrop", "drop_path", "drop_rate")


def _set_dropout(config: Any, p: float) -> None:
    """Every dropout probability of ``config`` and its sub-configs set to ``p`` (a per-stage list's every
    entry), LayerDrop's (a whole layer skipped at random: a branch on a random number, which a static
    graph cannot hold) and stochastic depth's (``drop_path_rate``: a sample's residual branch dropped at
    random, BEiT's 0.1) too."""
    for name, value in list(vars(config).items()):
        if _is_config(value):
            _set_dropout(value, p)
        elif any(k in name for k in _DROPOUTS) or name.endswith("pdrop"):
            if isinstance(value, float):
                setattr(config, name, p)
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, float) for v in value):
                setattr(config, name, type(value)(p for _ in value))


def build(arch: Architecture, device: str = "cpu", seed: int = 0, dropout: float | None = None,
          layers: int = LAYERS) -> torch.nn.Module:
    """The architecture at the test size with random weights (the same ones for the same seed);
    ``dropout``, when given, replaces every dropout probability of its config; ``layers``: layers
    of each stack (a default config with fewer keeps its own)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    cls = getattr(transformers, arch.name, None)
    if cls is None:
        raise ShrinkError(f"{arch.name}: transformers {transformers.__version__} lists it but does not export it")
    try:
        config = _config(arch, layers)
        if dropout is not None:
            _set_dropout(config, dropout)
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
    except Exception as exc:   # a sweep reports every cause, whatever transformers raises
        raise ShrinkError(f"{arch.name} does not build at the test size: {type(exc).__name__}: {exc}") from exc
    if arch.name.startswith("GPT2") and arch.task == "causal-lm":
        model.loss_type = "ForCausalLM"
    return model


def example(arch: Architecture, model: torch.nn.Module, batch: int, seed: int = 0,
            device: str = "cpu") -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` for ``batch`` sequences of SEQ tokens (labels: the tokens for
    language models, a class per sequence for classification); for an image classifier
    ``pixel_values`` (the channels and image size of its config, or of its vision config; in the
    model's floating dtype) and a class per image."""
    g = torch.Generator().manual_seed(seed)
    if arch.task == "image-classification":
        vision = getattr(model.config, "vision_config", None) or model.config
        size = getattr(vision, "image_size", IMAGE)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        pixels = torch.randn(batch, getattr(vision, "num_channels", 3), height, width, generator=g)
        labels = torch.randint(0, CLASSES, (batch,), generator=g)
        return {"pixel_values": pixels.to(device, dtype), "labels": labels.to(device)}
    vocab = getattr(model.config, "vocab_size", None) or getattr(model.config.get_text_config(), "vocab_size", VOCAB)
    ids = torch.randint(1, min(vocab, VOCAB), (batch, SEQ), generator=g)
    eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int) and 0 <= eos < vocab:
        # each sequence ends with its only end-of-sequence token: sequence classifiers of encoder-decoders
        # pool at it, and refuse a batch whose sequences hold different numbers of them
        ids[ids == eos] = 1 if eos != 1 else 2
        ids[:, -1] = eos
    labels = torch.randint(0, CLASSES, (batch,), generator=g) if arch.task == "classification" else ids.clone()
    return {"input_ids": ids.to(device), "labels": labels.to(device)}
