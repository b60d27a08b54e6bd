"""Planning's capture traces a few repeated blocks and copies them: the graph equals tracing them all.

Each case captures a model twice with :func:`autopar.capture.capture`: with its blocks copied
(capture/repeat.py) and with every block traced (``AUTOPAR_TRACE_EVERY_BLOCK=1``), and compares the
OpGraphs field by field (ops with their names, shapes, FLOPs, bytes, saved tensors, parameters and
module paths; layers and signatures; the parameters in order; MoE regions; the structure and its
fingerprint; the warnings, dtype notes included). Models whose copying would be wrong, or cannot be
checked, fall back to tracing every block, say why (repeat.Outcome), and still compare equal. Plans
made both ways are equal too. The suite runs a few representative models; make bench
(AUTOPAR_ALL_CASES=1) the rest, and test_repeat_registry.py every architecture of transformers'
registries.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import autopar  # noqa: E402
import autopar.capture as capture_pkg  # noqa: E402
from autopar import CaptureError  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.capture.repeat import ENV, export_program, find_blocks  # noqa: E402
from autopar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, build_mlp  # noqa: E402
from autopar.models.bert import BERTConfig, build_bert  # noqa: E402
from autopar.models.moe import MixtralConfig, build_mixtral  # noqa: E402
from autopar.models.t5 import T5Config, build_t5  # noqa: E402
from suite import ALL_CASES  # noqa: E402


def mse(output, inputs):
    return output.float().pow(2).mean()


def traced_every_block(call):
    """``call()`` with every block traced (the off switch)."""
    with mock.patch.dict(os.environ, {ENV: "1"}):
        return call()


@contextlib.contextmanager
def outcomes():
    """While open, the list of how each capture() exported (repeat.Outcome)."""
    seen = []
    real = capture_pkg.export_program

    def spy(*args, **kwargs):
        program, outcome = real(*args, **kwargs)
        seen.append(outcome)
        return program, outcome

    with mock.patch.object(capture_pkg, "export_program", spy):
        yield seen


def capture_both(model, inputs, loss_fn=None):
    """(how the blocks were captured, the graph): capture()'s graph, asserted equal to the one tracing
    every block gives."""
    with outcomes() as seen:
        copied = capture(model, inputs, loss_fn)
    whole = traced_every_block(lambda: capture(model, inputs, loss_fn))
    assert list(copied.params) == list(whole.params)
    for field in whole.__dataclass_fields__:
        assert getattr(copied, field) == getattr(whole, field), field
    assert copied.structure.fingerprint == whole.structure.fingerprint
    (outcome,) = seen
    return outcome, copied


# --- models that copy -------------------------------------------------------------------------

SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=64,
             max_position_embeddings=32, head_dim=8, use_cache=False)


def _hf(name: str):
    tf = pytest.importorskip("transformers")
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    tokens = {"input_ids": ids, "labels": ids}
    with torch.device("meta"):
        if name in ("gemma2", "gemma2_cache"):   # alternating sliding-window and global layers: a period of 2
            # seven layers: the last period is cut short (a sliding-window layer copied after the three traced)
            config = tf.Gemma2Config(num_hidden_layers=7, sliding_window=8, **{**SMALL, "use_cache": name != "gemma2"})
            return tf.Gemma2ForCausalLM(config), tokens
        if name == "gemma3":   # two sliding-window layers, then a global one: a period of 3
            config = tf.Gemma3TextConfig(num_hidden_layers=10, sliding_window=8, **SMALL,
                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 3
                                         + ["sliding_attention"])
            return tf.Gemma3ForCausalLM(config), tokens
        if name == "deepseek_v3":   # a dense first layer (its lead), then mixture-of-experts layers
            config = tf.DeepseekV3Config(
                num_hidden_layers=5, first_k_dense_replace=1, hidden_size=32, intermediate_size=64,
                moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, head_dim=8, vocab_size=64, max_position_embeddings=32,
                use_cache=False)
            return tf.DeepseekV3ForCausalLM(config), tokens
        if name == "qwen2_moe_dense_first":   # Qwen2-MoE with its first layer's MLP dense (mlp_only_layers)
            config = tf.Qwen2MoeConfig(num_hidden_layers=5, mlp_only_layers=[0], moe_intermediate_size=16,
                                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                       **{k: v for k, v in SMALL.items() if k != "head_dim"})
            return tf.Qwen2MoeForCausalLM(config), tokens
        if name == "t5":       # two containers, each with a first block unlike the rest (relative positions)
            config = tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=5, num_decoder_layers=5,
                                 vocab_size=64, decoder_start_token_id=0, use_cache=False)
            return tf.T5ForConditionalGeneration(config), tokens
        if name == "bart":
            config = tf.BartConfig(d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                                   max_position_embeddings=32, use_cache=False)
            return tf.BartForConditionalGeneration(config), tokens
        if name == "vit":      # int64 pixels the model casts itself: a dtype note, copied or not
            config = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4,
                                  num_attention_heads=4, intermediate_size=64, num_labels=10)
            return tf.ViTForImageClassification(config), {
                "pixel_values": torch.zeros(2, 3, 32, 32, dtype=torch.long, device="meta"),
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


# (builder, name) -> the containers copied: path -> (blocks traced, blocks). make bench (AUTOPAR_ALL_CASES=1)
# runs them (1-5 s each); the suite runs the custom stacks below and HF GPT-2 in test_estimate_equal_at_depth.
COPIED = {
    ("hf", "t5"): {"encoder.block": (4, 5), "decoder.block": (4, 5)},   # a lead in each of two containers
    ("builtin", "gpt"): {"blocks": (3, 5)},
    ("hf", "llama"): {"model.layers": (3, 5)},
    ("hf", "gemma2"): {"model.layers": (6, 7)},
    ("hf", "gpt2"): {"transformer.h": (3, 5)},
    ("hf", "gemma3"): {"model.layers": (9, 10)},
    ("hf", "mixtral"): {"model.layers": (3, 5)},
    ("hf", "qwen2_moe"): {"model.layers": (3, 5)},
    ("hf", "qwen2_moe_dense_first"): {"model.layers": (4, 5)},
    ("hf", "deepseek_v3"): {"model.layers": (4, 5)},
    ("hf", "bert"): {"bert.encoder.layer": (3, 5)},
    ("hf", "bart"): {"model.encoder.layers": (3, 4), "model.decoder.layers": (3, 4)},
    ("hf", "vit"): {"vit.layers": (3, 4)},
    ("builtin", "llama"): {"layers": (3, 5)},
    ("builtin", "mixtral"): {"layers": (3, 4)},
    ("builtin", "bert"): {"layers": (3, 4)},
    ("builtin", "t5"): {"encoder.blocks": (3, 5), "decoder.blocks": (3, 5)},
}


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1)")
@pytest.mark.parametrize("kind, name", sorted(COPIED))
def test_copied_blocks_equal_every_block_traced(kind, name) -> None:
    model, inputs = (_hf if kind == "hf" else _builtin)(name)
    outcome, graph = capture_both(model, inputs)
    expected = COPIED[(kind, name)]
    assert outcome.copied == tuple(f"{path}: {traced} of {n} blocks traced" for path, (traced, n) in expected.items())
    assert not outcome.fallback
    for path, (_, n) in expected.items():   # the blocks were put back
        container = model.get_submodule(path)
        assert len(container) == n and len(list(container.parameters())) > 0
    assert sum(layer.is_block for layer in graph.layers) >= sum(n for _, n in expected.values()) - 2
    if name == "vit":
        assert any("pixel_values is int64" in w for w in graph.warnings)


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1)")
def test_mlp_layers_copied() -> None:
    model, inputs = build_mlp(depth=6, device="meta")
    outcome, _ = capture_both(model, inputs, mse)
    assert outcome.copied and not outcome.fallback


# --- custom stacks: what copies and what must not ------------------------------------------------

class Block(nn.Module):
    def __init__(self, width: int, inner: int, index: int, act: str = "tanh") -> None:
        super().__init__()
        self.index = index
        self.act = act
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(getattr(torch, self.act)(self.up(x)))


class Stack(nn.Module):
    """``n`` blocks; ``how`` is what its forward does besides running them in order."""

    def __init__(self, how: str = "plain", n: int = 6, width: int = 8) -> None:
        super().__init__()
        self.how = how
        self.n = n
        self.inp = nn.Linear(4, width)
        inner = [2 * width + (i if how == "widths" else 2 if how == "lead" and i == 0 else 0) for i in range(n)]
        acts = ["relu" if how == "alternate" and i % 2 else "tanh" for i in range(n)]
        self.blocks = nn.ModuleList(Block(width, inner[i], i, acts[i]) for i in range(n))
        if how == "shared":
            self.blocks[4].up = self.blocks[3].up
        if how == "mix":   # bfloat16 blocks; float32 weights, more than three blocks' and fewer than six
            self.blocks.to(torch.bfloat16)
            self.extra = nn.Parameter(torch.ones(1200))
        if how == "two":   # a second container run after the first (an encoder, then a decoder)
            self.more = nn.ModuleList(Block(width, 3 * width, i) for i in range(n - 1))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.how == "mix":
            first, h = h, h.to(torch.bfloat16)
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
        for block in getattr(self, "more", ()):
            h = block(h)
        if self.how == "sum":
            h = sum(seen)
        if self.how == "second_last":
            h = seen[-2]
        if self.how == "fifth":
            h = seen[4]
        if self.how == "mix":   # a product of activations in two dtypes (no weight says which is odd)
            h = nn.functional.linear(first, h) @ first
        return self.out(h).float().pow(2).mean()


def _stack(how: str, n: int = 6):
    with torch.device("meta"):
        return Stack(how, n), (torch.zeros(2, 4, device="meta"),)


@pytest.mark.parametrize("how, n, copied", [
    ("plain", 6, ("blocks: 3 of 6 blocks traced",)),
    ("alternate", 7, ("blocks: 6 of 7 blocks traced",)),   # two kinds in turn: a period of 2, the last cut short
    ("lead", 5, ("blocks: 4 of 5 blocks traced",)),        # a first block unlike the rest, then a period of 1
    ("two", 6, ("blocks: 3 of 6 blocks traced", "more: 3 of 5 blocks traced")),
])
def test_stack_copied(how, n, copied) -> None:
    outcome, _ = capture_both(*_stack(how, n))
    assert outcome.copied == copied and not outcome.fallback and not outcome.skipped


@pytest.mark.parametrize("how, n, why", [
    ("widths", 6, "blocks: 6 blocks, not more than a lead of"),    # blocks not interchangeable
    ("shared", 6, "blocks: block 3 shares a module or a weight"),   # a weight in two blocks
    ("plain", 3, "blocks: 3 blocks, not more than a lead of 0 and 3 periods of 1"),   # too few to gain
])
def test_blocks_that_differ_are_not_copied(how, n, why) -> None:
    found, skipped = find_blocks(_stack(how, n)[0])
    assert not found and any(line.startswith(why) for line in skipped), skipped


FALLBACKS = {   # how -> why; what the suite runs (make bench: all)
    "range": "IndexError: index 3 is out of range",     # forward indexes range(self.n): fails when cut
    "second": "reads other values than",                # block 1's output doubled: block 2 reads it
    "last": "goes through the blocks 4 times",          # len(blocks) read at every block
    "second_last": "after the blocks reads",            # a read counted from the end
}
MORE_FALLBACKS = {
    "fifth": "IndexError: list index out of range",     # the output of block 4 read by its index
    "index": "reads other values than",                 # scaled by the block's own index
    "count": "goes through the blocks 2 times",         # their count read
    "twice": "goes through the blocks 2 times",         # a loop over them besides the one that runs them
    "sum": "after the blocks reads",                    # every block's output read after the blocks
}


@pytest.mark.parametrize("how", sorted(FALLBACKS) + (sorted(MORE_FALLBACKS) if ALL_CASES else []))
def test_forward_that_changes_when_cut_falls_back(how) -> None:
    """The program is then the export of every block (an ExportedProgram), and the model is put back."""
    model, inputs = _stack(how)
    program, outcome = export_program(model, inputs, None)
    why = {**FALLBACKS, **MORE_FALLBACKS}[how]
    assert not outcome.copied and why in outcome.fallback, outcome.fallback
    assert isinstance(program, torch.export.ExportedProgram)
    assert len(model.blocks) == 6 and len(list(model.parameters())) == 2 + 4 * 6 + 2


def test_dtype_errors_are_the_whole_model_s() -> None:
    """capture's dtype check reads the program with blocks copied, all of the model's weights: a product
    of a float32 and a bfloat16 activation is blamed on the operand whose dtype most of the weights do
    not have (bfloat16 with three blocks, float32 with six)."""
    model, inputs = _stack("mix")
    with pytest.raises(CaptureError) as copied:
        capture(model, inputs)
    with pytest.raises(CaptureError) as whole:
        traced_every_block(lambda: capture(model, inputs))
    assert str(copied.value) == str(whole.value)
    assert "parameters mix float32 (inp.weight) and bfloat16" in str(copied.value)


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1)")
def test_per_layer_values_made_before_the_blocks_fall_back() -> None:
    """Gemma2 with its cache on makes each sliding-window layer's cache tensors before the layers run:
    a value per layer the cut model does not make for the copies."""
    outcome, _ = capture_both(*_hf("gemma2_cache"))
    assert not outcome.copied and "reads other values than" in outcome.fallback


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1)")
def test_loss_of_a_layer_s_hidden_states_falls_back() -> None:
    """A loss of the second-to-last layer's hidden states (output_hidden_states: transformers records
    them with hooks it adds to every layer, walking the layers)."""
    model, inputs = _hf("llama")
    model.config.output_hidden_states = True
    outcome, _ = capture_both(model, inputs, lambda out, _: out.hidden_states[-2].float().pow(2).mean())
    assert not outcome.copied and "goes through the blocks" in outcome.fallback


# --- plans ------------------------------------------------------------------------------------

def _hf12(name: str):
    pytest.importorskip("transformers")
    from autopar.models.hf import build_hf_gpt2, build_hf_llama
    build = build_hf_gpt2 if name == "gpt2" else build_hf_llama
    return build(layers=12, hidden=64, heads=4, vocab=256, seq_len=32, device="meta")


def test_estimate_equal_at_depth() -> None:
    """A 12-layer GPT-2 priced at pp=4 (stages cut through the copies): the same Plan."""
    model, inputs = _hf12("gpt2")
    cluster = autopar.Cluster.from_spec("1x8xA100-80GB")
    config = autopar.ParallelConfig(dp=2, tp=1, pp=4, micro_batch_size=2)

    def run():
        return autopar.estimate(model, cluster, inputs, config, global_batch_size=16).to_json()

    with outcomes() as seen:
        copied = run()
    assert [outcome.copied for outcome in seen] == [("transformer.h: 3 of 12 blocks traced",)]
    assert copied == traced_every_block(run)


@pytest.mark.skipif(not ALL_CASES, reason="make bench (AUTOPAR_ALL_CASES=1)")
@pytest.mark.parametrize("name, spec", [("gpt2", "1x8xA100-80GB"), ("llama", "2x8xH100-SXM")])
def test_plans_equal_at_depth(name, spec) -> None:
    model, inputs = _hf12(name)

    def run():
        return autopar.plan(model, autopar.Cluster.from_spec(spec), inputs, global_batch_size=32,
                            verbose=False).to_json()

    with outcomes() as seen:
        copied = run()
    assert [outcome.copied for outcome in seen] == [(f"{'transformer.h' if name == 'gpt2' else 'model.layers'}: "
                                                     "3 of 12 blocks traced",)]
    assert copied == traced_every_block(run)


def test_switched_off_by_the_environment() -> None:
    program, outcome = traced_every_block(lambda: export_program(*_stack("plain"), None))
    assert outcome.copied == () and outcome.skipped == () and outcome.fallback == ""
    assert isinstance(program, torch.export.ExportedProgram)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2", "deepseek_v3"])
def test_hugging_face_blocks_are_found_without_exporting(name):
    """The blocks of the Hugging Face decoders are interchangeable as built (no export here, so the suite runs
    it on every change): transformers v5 gives each attention module its own stateless kernel-function
    holders (``_kernel_funcs``), compared by type and attributes, not identity (they once made every Llama
    block a kind of its own: the 405B shape exported all 126 blocks, 15 s instead of 2)."""
    model, _ = _hf(name)
    found, skipped = find_blocks(model)
    assert found and not skipped, skipped
