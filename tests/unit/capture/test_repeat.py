"""Planning's capture traces a few repeated blocks and copies them: the graph equals tracing them all.

Each case captures a model twice, with its blocks copied (capture/repeat.py) and with every block
traced (``AUTOPAR_TRACE_EVERY_BLOCK=1``), and compares the OpGraphs field by field (ops with their
names, shapes, FLOPs, bytes, saved tensors, parameters and module paths; layers and signatures; the
parameters in order; MoE regions; the structure and its fingerprint). Models whose copying would be
wrong, or cannot be checked, fall back to tracing every block, and still compare equal.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.capture import capture, graph_of  # noqa: E402
from autopar.capture.export import run_export  # noqa: E402
from autopar.capture.repeat import ENV, export_program  # noqa: E402
from autopar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, build_mlp  # noqa: E402
from autopar.models.bert import BERTConfig, build_bert  # noqa: E402
from autopar.models.moe import MixtralConfig, build_mixtral  # noqa: E402
from autopar.models.t5 import T5Config, build_t5  # noqa: E402
from suite import ALL_CASES  # noqa: E402


def mse(output, inputs):
    return output.float().pow(2).mean()


def compare(model, inputs, loss_fn=None):
    """(outcome, graph with blocks copied); asserts it equals the graph of every block traced."""
    program, outcome = export_program(model, inputs, loss_fn)
    copied = graph_of(model, program)
    whole = graph_of(model, run_export(model, inputs, loss_fn))
    assert list(copied.params) == list(whole.params)
    for field in whole.__dataclass_fields__:
        assert getattr(copied, field) == getattr(whole, field), field
    assert copied.structure.fingerprint == whole.structure.fingerprint
    return outcome, copied


# --- models that copy -------------------------------------------------------------------------

def _hf(name: str):
    tf = pytest.importorskip("transformers")
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    tokens = {"input_ids": ids, "labels": ids}
    small = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                 max_position_embeddings=32, head_dim=8)
    with torch.device("meta"):
        if name in ("gemma2", "gemma2_cache"):   # alternating sliding-window and global layers: a period of 2
            return tf.Gemma2ForCausalLM(tf.Gemma2Config(num_hidden_layers=8, sliding_window=8,
                                                        use_cache=name == "gemma2_cache", **small)), tokens
        if name == "gemma3":   # two sliding-window layers, then a global one: a period of 3
            config = tf.Gemma3TextConfig(num_hidden_layers=10, sliding_window=8, **small,
                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 3
                                         + ["sliding_attention"])
            return tf.Gemma3ForCausalLM(config), tokens
        if name == "t5":       # two containers, each with a first block unlike the rest
            config = tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=5, num_decoder_layers=5,
                                 vocab_size=64, decoder_start_token_id=0)
            return tf.T5ForConditionalGeneration(config), tokens
        if name == "bart":
            config = tf.BartConfig(d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                                   max_position_embeddings=32)
            return tf.BartForConditionalGeneration(config), tokens
        if name == "vit":
            config = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=64, num_labels=10)
            return tf.ViTForImageClassification(config), {
                "pixel_values": torch.zeros(2, 3, 32, 32, device="meta"),
                "labels": torch.zeros(2, dtype=torch.long, device="meta")}
    from autopar.models.hf import build_hf_bert, build_hf_gpt2, build_hf_llama, build_hf_mixtral, build_hf_qwen2_moe
    sizes = dict(layers=5, hidden=32, heads=4, vocab=64, seq_len=16, device="meta")
    if name == "gpt2":
        return build_hf_gpt2(**sizes)
    if name == "llama":
        return build_hf_llama(**sizes, ffn_hidden=64)
    if name == "bert":
        return build_hf_bert(**sizes, ffn_hidden=64)
    if name == "mixtral":
        return build_hf_mixtral(**sizes, ffn_hidden=64)
    if name == "qwen2_moe":
        return build_hf_qwen2_moe(**sizes, ffn_hidden=48, shared_ffn_hidden=64)
    raise KeyError(name)


def _builtin(name: str):
    if name == "gpt":
        return build_gpt(GPTConfig(vocab_size=64, hidden=32, heads=4, layers=5, seq_len=16), 2, device="meta")
    if name == "llama":
        return build_llama(LlamaConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, layers=5, ffn_hidden=64,
                                       seq_len=16), 2, device="meta")
    if name == "mixtral":
        return build_mixtral(MixtralConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, layers=4, ffn_hidden=64,
                                           seq_len=16, num_experts=4), 2, device="meta")
    if name == "bert":
        return build_bert(BERTConfig(vocab_size=64, hidden=32, heads=4, layers=4, seq_len=16), 2, device="meta")
    if name == "t5":
        return build_t5(T5Config(vocab_size=64, hidden=32, heads=4, ffn_hidden=64, layers=5, seq_len=16,
                                 decoder_seq_len=8), 2, device="meta")
    raise KeyError(name)


# (builder, name, the containers copied: path -> (blocks traced, blocks))
COPIED = {
    ("hf", "gpt2"): {"transformer.h": (3, 5)},
    ("hf", "llama"): {"model.layers": (3, 5)},
    ("hf", "gemma2"): {"model.layers": (6, 8)},
    ("hf", "mixtral"): {"model.layers": (3, 5)},
    ("hf", "t5"): {"encoder.block": (4, 5), "decoder.block": (4, 5)},
    ("hf", "bert"): {"bert.encoder.layer": (3, 5)},
    ("hf", "vit"): {"vit.layers": (3, 4)},
    ("builtin", "gpt"): {"blocks": (3, 5)},
    ("builtin", "t5"): {"encoder.blocks": (3, 5), "decoder.blocks": (3, 5)},
}
MORE = {   # make bench (AUTOPAR_ALL_CASES=1)
    ("hf", "gemma3"): {"model.layers": (9, 10)},
    ("hf", "qwen2_moe"): {"model.layers": (3, 5)},
    ("hf", "bart"): {"model.encoder.layers": (3, 4), "model.decoder.layers": (3, 4)},
    ("builtin", "llama"): {"layers": (3, 5)},
    ("builtin", "mixtral"): {"layers": (3, 4)},
    ("builtin", "bert"): {"layers": (3, 4)},
}


@pytest.mark.parametrize("kind, name", sorted(COPIED) + (sorted(MORE) if ALL_CASES else []))
def test_copied_blocks_equal_every_block_traced(kind, name) -> None:
    model, inputs = (_hf if kind == "hf" else _builtin)(name)
    outcome, graph = compare(model, inputs)
    expected = {**COPIED, **MORE}[(kind, name)]
    assert outcome.copied == tuple(f"{path}: {traced} of {n} blocks traced" for path, (traced, n) in expected.items())
    assert not outcome.fallback
    for path, (_, n) in expected.items():   # the blocks were put back
        container = model.get_submodule(path)
        assert len(container) == n and len(list(container.parameters())) > 0
    assert sum(layer.is_block for layer in graph.layers) >= sum(n for _, n in expected.values()) - 2


def test_mlp_layers_copied() -> None:
    model, inputs = build_mlp(depth=6, device="meta")
    outcome, _ = compare(model, inputs, mse)
    assert outcome.copied and not outcome.fallback


# --- models that must not be copied ------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, width: int, inner: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    """Six blocks; ``how`` is what its forward does besides running them in order."""

    def __init__(self, how: str = "plain", width: int = 8) -> None:
        super().__init__()
        self.how = how
        self.n = 6
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width, 2 * width + (i if how == "widths" else 0), i) for i in range(6))
        if how == "shared":
            self.blocks[4].up = self.blocks[3].up
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.how == "count":
            h = h * len(self.blocks)
        if self.how == "twice":
            h = h + sum(block.up.bias.sum() for block in self.blocks)
        seen = []
        if self.how == "range":
            for i in range(self.n):
                h = self.blocks[i](h)
        else:
            for i, block in enumerate(self.blocks):
                h = block(h)
                if self.how == "second" and i == 1:
                    h = h * 2
                if self.how == "last" and i == len(self.blocks) - 1:
                    h = h * 2
                if self.how == "index":
                    h = h * (block.index + 1)
                seen.append(h)
        if self.how == "sum":
            h = sum(seen)
        if self.how == "second_last":
            h = seen[-2]
        return self.out(h).float().pow(2).mean()


def _stack(how: str):
    with torch.device("meta"):
        return Stack(how), (torch.zeros(2, 4, device="meta"),)


def test_plain_stack_copied() -> None:
    outcome, _ = compare(*_stack("plain"))
    assert outcome.copied == ("blocks: 3 of 6 blocks traced",) and not outcome.fallback


@pytest.mark.parametrize("how, why", [
    ("widths", "blocks: 6 blocks, not more than a lead of"),        # blocks not interchangeable
    ("shared", "blocks: block 3 shares a module or a weight"),       # a weight in two blocks
])
def test_blocks_that_differ_are_traced(how, why) -> None:
    outcome, _ = compare(*_stack(how))
    assert not outcome.copied and not outcome.fallback
    assert any(line.startswith(why) for line in outcome.skipped), outcome.skipped


@pytest.mark.parametrize("how, why", [
    ("range", "IndexError: index 3 is out of range"),      # forward indexes range(self.n): fails when cut
    ("second", "reads other values than"),                  # block 1's output doubled: block 2 reads it
    ("last", "goes through the blocks 4 times"),            # len(blocks) read at every block
    ("index", "reads other values than"),                   # scaled by the block's own index
    ("count", "goes through the blocks 2 times"),           # their count read
    ("twice", "goes through the blocks 2 times"),           # a loop over them besides the one that runs them
    ("sum", "after the blocks reads"),                      # every block's output read after the blocks
    ("second_last", "after the blocks reads"),              # a read counted from the end
])
def test_forward_that_changes_when_cut_falls_back(how, why) -> None:
    model, inputs = _stack(how)
    outcome, _ = compare(model, inputs)
    assert not outcome.copied and why in outcome.fallback, outcome.fallback
    assert len(model.blocks) == 6 and len(list(model.parameters())) == 2 + 4 * 6 + 2   # put back


def test_per_layer_values_made_before_the_blocks_fall_back() -> None:
    """Gemma2 with its cache on makes each sliding-window layer's cache tensors before the layers run:
    a value per layer the cut model does not make for the copies."""
    outcome, _ = compare(*_hf("gemma2_cache"))
    assert not outcome.copied and "reads other values than" in outcome.fallback


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "1")
    program, outcome = export_program(*_stack("plain"), None)
    assert outcome.copied == () and outcome.fallback == ""
    assert hasattr(program, "state_dict")   # an ExportedProgram of every block


def test_capture_uses_it(monkeypatch) -> None:
    model, inputs = _stack("plain")
    copied = capture(model, inputs)
    monkeypatch.setenv(ENV, "1")
    assert capture(model, inputs) == copied
