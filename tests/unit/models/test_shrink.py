"""autopar.models.shrink: any registered Hugging Face architecture at a test size."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from autopar.models import shrink  # noqa: E402


def test_registries_listed_once_each():
    archs = shrink.architectures()
    names = [a.name for a in archs]
    assert len(names) == len(set(names)) > 300
    assert {a.task for a in archs} == set(shrink.REGISTRIES)
    by_name = {a.name: a for a in archs}
    assert by_name["LlamaForCausalLM"].task == "causal-lm"
    assert by_name["BertForMaskedLM"].task == "masked-lm"
    assert by_name["T5ForConditionalGeneration"].task == "seq2seq"
    assert by_name["GPT2ForSequenceClassification"].task == "classification"


def test_shrink_sizes_sub_configs_and_per_layer_lists():
    config = transformers.Gemma2Config()          # 26 layers with a layer_types list, hidden 2304
    assert len(config.layer_types) > shrink.LAYERS
    shrink.shrink(config)
    assert config.num_hidden_layers == shrink.LAYERS and len(config.layer_types) == shrink.LAYERS
    assert config.hidden_size == shrink.HIDDEN and config.vocab_size == shrink.VOCAB
    assert config.num_attention_heads % config.num_key_value_heads == 0
    t5 = transformers.T5Config(num_layers=12, num_decoder_layers=12, d_model=768)
    shrink.shrink(t5)
    assert (t5.num_layers, t5.num_decoder_layers, t5.d_model) == (shrink.LAYERS, shrink.LAYERS, shrink.HIDDEN)
    small = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1)
    shrink.shrink(small)
    assert (small.hidden_size, small.num_hidden_layers) == (32, 1)   # only downwards


def test_shrink_to_a_depth():
    """``layers=``: the repeated-block captures are checked at a depth with copies (test_repeat_registry.py)."""
    config = shrink.shrink(transformers.Gemma2Config(), layers=8)
    assert config.num_hidden_layers == 8 and len(config.layer_types) == 8
    assert config.hidden_size == shrink.HIDDEN
    t5 = shrink.shrink(transformers.T5Config(num_layers=12, num_decoder_layers=12), layers=8)
    assert (t5.num_layers, t5.num_decoder_layers) == (8, 8)
    assert shrink.shrink(transformers.LlamaConfig(num_hidden_layers=4), layers=8).num_hidden_layers == 4


def test_multi_head_latent_attention_ropes_its_own_head_dim():
    config = shrink.shrink(transformers.DeepseekV3Config())
    assert config.head_dim == config.qk_rope_head_dim
    assert config.n_routed_experts == shrink.EXPERTS and config.num_experts_per_tok == shrink.TOP_K


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration",
                                  "BartForSequenceClassification"])
def test_build_gives_a_small_model_with_a_loss(name):
    arch = next(a for a in shrink.architectures() if a.name == name)
    model = shrink.build(arch, dropout=0.0)
    assert sum(p.numel() for p in model.parameters()) < 500_000
    assert not any(isinstance(v, float) and v > 0 for k, v in vars(model.config).items() if "dropout" in k)
    batch = shrink.example(arch, model, 2)
    loss = model(**batch).loss
    assert loss.ndim == 0 and loss.isfinite()
    again = shrink.build(arch, dropout=0.0)
    first = next(iter(model.state_dict().values()))
    assert first.equal(next(iter(again.state_dict().values())))   # same seed, same weights


def test_what_cannot_be_built_says_which_and_why():
    fake = shrink.Architecture("NoSuchModelForCausalLM", "llama", "causal-lm")
    with pytest.raises(shrink.ShrinkError, match="NoSuchModelForCausalLM: transformers .* does not export it"):
        shrink.build(fake)


def test_key_value_heads_keep_the_grouping_of_the_defaults():
    """Attention without key/value groups stays ungrouped (multi-head latent attention projects keys and
    values for every head; transformers repeats them by heads // num_key_value_heads when tracing), and
    grouped-query attention stays grouped."""
    mla = shrink.shrink(transformers.Glm4MoeLiteConfig())
    assert mla.num_key_value_heads == mla.num_attention_heads == shrink.HEADS
    gqa = shrink.shrink(transformers.MistralConfig())   # 32 heads, 8 key/value heads
    assert (gqa.num_attention_heads, gqa.num_key_value_heads) == (shrink.HEADS, shrink.KV_HEADS)


def test_dropout_off_turns_layerdrop_off():
    """LayerDrop skips a whole layer when a random number falls below it: a branch on a tensor's
    value, which a static graph cannot hold, so the sweep's dropout=0 turns it off with the rest."""
    arch = next(a for a in shrink.architectures() if a.name == "M2M100ForConditionalGeneration")
    assert transformers.M2M100Config().encoder_layerdrop > 0
    config = shrink.build(arch, "meta", dropout=0.0).config
    assert config.encoder_layerdrop == config.decoder_layerdrop == 0.0


def test_latent_and_convolutional_encoders_shrink_too():
    """Perceiver's latent width and self-attention layers, and a convolutional audio encoder's first
    width and per-stage depths (each stage doubles the width): left at their defaults they made 270 M
    and 690 M parameter "test-size" models whose ranks the sweep's machine killed for memory."""
    for name, most in (("PerceiverForSequenceClassification", 1e6), ("VibeVoiceAsrForConditionalGeneration", 2e7)):
        arch = next(a for a in shrink.architectures() if a.name == name)
        assert sum(p.numel() for p in shrink.build(arch, "meta", dropout=0.0).parameters()) < most, name
    encoder = shrink.shrink(transformers.VibeVoiceAsrConfig()).acoustic_tokenizer_encoder_config
    assert set(encoder.depths) == {1} and encoder.num_filters == 8


@pytest.mark.parametrize("name", ["ViTForImageClassification", "SwinForImageClassification",
                                  "ResNetForImageClassification"])
def test_image_classifiers_build_small_and_take_pixels(name):
    """transformers' image-classification registry: images IMAGE pixels a side, a stage-wise encoder
    (Swin, ResNet) keeping its stage count and the widths and windows that depend on it."""
    arch = next(a for a in shrink.architectures() if a.name == name)
    assert arch.task == "image-classification"
    model = shrink.build(arch, dropout=0.0)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    batch = shrink.example(arch, model, 2)
    assert batch["pixel_values"].shape == (2, 3, shrink.IMAGE, shrink.IMAGE) and batch["pixel_values"].is_floating_point()
    assert batch["labels"].shape == (2,) and int(batch["labels"].max()) < shrink.CLASSES
    loss = model(**batch).loss
    assert loss.ndim == 0 and loss.isfinite()


def test_a_stage_wise_encoder_keeps_its_stages():
    default = transformers.SwinConfig()   # 4 stages, embed_dim 96, heads 3..24, window 7
    config = shrink.shrink_images(shrink.shrink(transformers.SwinConfig()), default)
    assert config.num_layers == len(config.depths) == 4 and set(config.depths) == {1}
    assert config.hidden_size == config.embed_dim * 8
    assert all((config.embed_dim * 2 ** i) % h == 0 for i, h in enumerate(config.num_heads))
    assert config.window_size <= shrink.IMAGE // config.patch_size // 8


def test_dropout_off_turns_stochastic_depth_off_and_pixels_follow_the_dtype():
    """BEiT drops a sample's residual branch at random (drop_path_rate 0.1): with it on, its dp=2 loss
    differed from one process's. A float64 model (the sweep's second look) gets float64 pixels."""
    arch = next(a for a in shrink.architectures() if a.name == "BeitForImageClassification")
    assert transformers.BeitConfig().drop_path_rate > 0
    model = shrink.build(arch, "meta", dropout=0.0)
    assert model.config.drop_path_rate == 0.0
    assert shrink.example(arch, model.double(), 1, device="meta")["pixel_values"].dtype == torch.float64
