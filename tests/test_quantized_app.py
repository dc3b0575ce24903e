"""The app with quantized weights (`weights` = fp8, int4) on the demo model: it answers text, images,
audio, video and speech with the tokens and codes of transformers' own `generate` run on the same
quantized model, holds no full-precision copy of the layers it quantizes, and its prefix cache never
changes an answer. (The formats and kernels themselves: test_quantized_weights.py.)"""

import pytest
import torch

from replies import media, reference_tokens, send, transformers_speech
from samples import clip, picture, video_file
from omni_local.api import OmniLocal
from omni_local.api.messages import Message
from omni_local.model.quantized import QuantizedExperts, QuantizedLinear, quantized_decoder_stacks

FORMATS = ["fp8", "int4"]
STORED = {"fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn), "int4": (torch.uint8, torch.int8)}  # experts, attention


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
    assert {"thinker.lm_head.weight", "thinker.model.language_model.embed_tokens.weight",
            "thinker.model.language_model.layers.0.mlp.gate.weight"} <= full_precision


CASES = {
    "text": lambda app: ["Tell me a story about a lighthouse keeper."],
    "image": lambda app: [picture(1), "What is in this picture?"],
    "audio": lambda app: [clip(2), "What did you hear?"],
    "video": lambda app: [app.read_video(video_file(3, seconds=1.0)), "What happens in this video?"],
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.torchvision) if c == "video" else c
                                  for c in CASES])
def test_a_written_reply_is_transformers_generate_on_the_same_quantized_model(quantized_app, case):
    parts = CASES[case](quantized_app)
    videos = parts[:1] if case == "video" else []

    final = quantized_app.session().send(parts[-1], videos=videos, max_new_tokens=24, **media(parts)).result()

    assert final.token_ids == reference_tokens(quantized_app, [Message("user", parts)])
    assert len(final.token_ids) > 8


def test_a_spoken_reply_has_the_codes_of_transformers_generate_on_the_same_quantized_model(quantized_app):
    parts = ["Sing me a song about the sea."]
    final, frames, _, _ = send(quantized_app, quantized_app.session(), parts[-1], voice="Chelsie")
    text, codes = transformers_speech(quantized_app, [Message("user", parts)], "Chelsie")
    assert final.token_ids == text and len(text) > 8
    assert frames == codes.T.tolist() and final.speech.frames > 0


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
