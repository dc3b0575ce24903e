"""The app with quantized weights (`weights` = fp8, int4) on the demo model: it answers text, images,
audio, video and speech with the tokens and codes of transformers' own `generate` run on the same
quantized model, holds no full-precision copy of the layers it quantizes, and its prefix cache never
changes an answer. (The formats and kernels themselves: test_quantized_weights.py.)"""

import pytest
import torch

from replies import assert_spoken_reply_is_generates, assert_written_reply_is_generates
from samples import QUESTIONS, picture, video_file
from omni_local.api import OmniLocal
from omni_local.model.quantized import (QuantizedEmbedding, QuantizedExperts, QuantizedLinear, encoder_towers,
                                        quantized_decoder_stacks)

FORMATS = ["fp8", "int4"]
STORED = {"fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn), "int4": (torch.uint8, torch.int8)}  # experts, attention
THINKER_HEADS = {"thinker.lm_head.weight", "thinker.model.language_model.embed_tokens.weight"}


@pytest.fixture(scope="module", params=FORMATS)
def quantized_app(request, demo_settings, demo_checkpoint):
    settings = demo_settings.replace(weights=request.param, speech=True, max_speech_seconds=1.0)
    with OmniLocal(settings) as app:
        yield app


def test_the_thinkers_and_talkers_experts_and_attention_projections_are_held_quantized_and_nothing_else(
    quantized_app,
):
    model = quantized_app.backend.loaded.model
    experts_dtype, attention_dtype = STORED[quantized_app.settings.weights]
    for stack in quantized_decoder_stacks(model):
        for layer in stack.layers:
            assert isinstance(layer.mlp.experts, QuantizedExperts)
            assert layer.mlp.experts.gate_up_values.dtype == layer.mlp.experts.down_values.dtype == experts_dtype
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                projection = getattr(layer.self_attn, name)
                assert isinstance(projection, QuantizedLinear) and projection.values.dtype == attention_dtype
    full_precision = {name for name, p in model.named_parameters() if p.dtype == torch.float32}
    in_stacks = {name for name in full_precision if name.startswith(("thinker.model.language_model.", "talker.model."))}
    assert not any(".mlp.experts." in name or name.endswith("_proj.weight") and ".self_attn." in name
                   for name in in_stacks)
    assert "thinker.model.language_model.layers.0.mlp.gate.weight" in full_precision


def test_int4_also_holds_the_thinkers_embeddings_lm_head_and_encoder_linears_in_int8_where_fp8_leaves_them(
    quantized_app,
):
    model = quantized_app.backend.loaded.model
    full_precision = {name for name, p in model.named_parameters() if p.dtype == torch.float32}
    encoder_modules = [module for tower in encoder_towers(model) for module in tower.modules()]
    quantized = [module for module in encoder_modules if isinstance(module, QuantizedLinear)]
    if quantized_app.settings.weights == "fp8":
        assert THINKER_HEADS <= full_precision and quantized == []
        return
    assert not THINKER_HEADS & full_precision
    assert isinstance(model.thinker.get_input_embeddings(), QuantizedEmbedding)
    assert model.thinker.lm_head.values.dtype == model.thinker.get_input_embeddings().values.dtype == torch.int8
    assert not any(isinstance(module, torch.nn.Linear) for module in encoder_modules)
    assert quantized and all(layer.values.dtype == torch.int8 and layer.batched for layer in quantized)
    # The convolutions and position tables stay, and the embeddings' rows come out in the model's dtype.
    assert "thinker.model.visual.patch_embed.proj.weight" in full_precision
    assert model.thinker.get_input_embeddings()(torch.tensor([[1, 2]])).dtype == torch.float32


@pytest.mark.parametrize("case", [*QUESTIONS, pytest.param("video", marks=pytest.mark.torchvision)])
def test_a_written_reply_is_transformers_generate_on_the_same_quantized_model(quantized_app, case):
    if case == "video":
        parts = [quantized_app.read_video(video_file(3, seconds=1.0)), "What happens in this video?"]
        assert_written_reply_is_generates(quantized_app, parts, videos=parts[:1])
    else:
        assert_written_reply_is_generates(quantized_app, QUESTIONS[case]())


def test_a_spoken_reply_has_the_codes_of_transformers_generate_on_the_same_quantized_model(quantized_app):
    assert_spoken_reply_is_generates(quantized_app, "Sing me a song about the sea.")


def test_a_chats_second_turn_is_the_same_with_the_prefix_cache_on_and_off(quantized_app):
    off = quantized_app.settings.replace(prefix_cache=False, encoder_cache=False, speech=False)
    turns = [([picture(4)], "What is in this picture?"), ([], "And what colour is it?")]

    def chat(app: OmniLocal) -> list[list[int]]:
        session = app.session()
        return [session.send(text, images=images, max_new_tokens=16).result().token_ids for images, text in turns]

    cached = chat(quantized_app)
    with OmniLocal(off) as uncached_app:
        assert chat(uncached_app) == cached
    assert quantized_app.backend.engine.cache.entries, "the cached app kept the chat's KV"
