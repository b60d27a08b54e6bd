"""A small zoo of model builders for demos, tests and benchmarks.

Every builder returns ``(model, example_inputs)`` with the batch on dim 0, builds
on any device (``device="meta"`` allocates nothing) in any floating ``dtype``, and
gives a model that ``torch.export.export(..., strict=False)`` captures in train mode.
Transformers take ``{input_ids, labels}`` (T5 also ``decoder_input_ids``) and return
the loss; the MLP and CNN take a tuple and return outputs (callers pass a ``loss_fn``).
The Hugging Face builders live in :mod:`autopar.models.hf` (transformers is optional)
and are re-exported here; they import transformers only when called.
"""

from .bert import BERT, BERTConfig, bert_param_count, build_bert
from .cnn import (BasicBlock, Bottleneck, ResNet, build_resnet, resnet, resnet18, resnet50,
                  small_resnet)
from .gpt import GPT, GPTConfig, build_gpt, gpt_param_count
from .hf import build_hf_bert, build_hf_gpt2, build_hf_gpt_neox, build_hf_llama
from .llama import Llama, LlamaConfig, build_llama, llama_param_count
from .mlp import MLP, build_mlp
from .moe import Mixtral, MixtralConfig, MoE, build_mixtral, mixtral_param_count
from .registry import ModelSpec, build, describe, names
from .t5 import T5, T5Config, build_t5, t5_param_count

__all__ = [
    "GPT", "GPTConfig", "build_gpt", "gpt_param_count",
    "Llama", "LlamaConfig", "build_llama", "llama_param_count",
    "Mixtral", "MixtralConfig", "MoE", "build_mixtral", "mixtral_param_count",
    "BERT", "BERTConfig", "build_bert", "bert_param_count",
    "T5", "T5Config", "build_t5", "t5_param_count",
    "MLP", "build_mlp",
    "ResNet", "BasicBlock", "Bottleneck", "resnet", "resnet18", "resnet50", "small_resnet", "build_resnet",
    "build_hf_gpt2", "build_hf_gpt_neox", "build_hf_llama", "build_hf_bert",
    "ModelSpec", "build", "describe", "names",
]
