"""The engine's own Thinker loop gives exactly the tokens of transformers' `thinker.generate`."""

import pytest
import torch

from replies import NEW_TOKENS, media, model_inputs, reference_tokens
from samples import clip, picture
from omni_local.api import OmniLocal
from omni_local.engine.prompt.builder import build_prompt
from omni_local.protocol.messages import Message

CASES = {
    "text": lambda: ["Tell me a story about a lighthouse keeper."],
    "image": lambda: [picture(1), "What is in this picture?"],
    "audio": lambda: [clip(2), "What did you hear?"],
    "image and audio": lambda: [picture(3, (224, 224)), clip(4, 3.0), "Describe both."],
}


@pytest.mark.parametrize("case", CASES)
def test_a_single_turn_matches_transformers_generate(app, case):
    parts = CASES[case]()
    system = Message("system", ["You are a helpful assistant."])
    session = app.session(system_prompt="You are a helpful assistant.")
    final = session.send(text=parts[-1], **media(parts), max_new_tokens=NEW_TOKENS).result()
    assert final.token_ids == reference_tokens(app, [system, Message("user", parts)])
    assert final.token_ids, "the reply must not be empty, or the comparison proves little"


def test_a_three_turn_conversation_matches_transformers_generate_at_every_turn(app):
    session = app.session(system_prompt="You answer in one sentence.")
    turns = [
        {"text": "Look at this.", "images": [picture(5)]},
        {"text": "And listen to this.", "audio": [clip(6, 1.5)]},
        {"text": "Which did you like more?"},
    ]
    for turn in turns:
        before = list(session.history)
        user = Message("user", [*turn.get("images", []), *turn.get("audio", []), turn["text"]])
        final = session.send(**turn, max_new_tokens=NEW_TOKENS).result()
        assert final.token_ids == reference_tokens(app, [*before, user])
    assert [m.role for m in session.history] == ["system"] + ["user", "assistant"] * 3


def test_greedy_with_a_repetition_penalty_matches_transformers_generate(app):
    messages = [Message("user", ["Tell me a story about a lighthouse keeper."])]
    prompt = build_prompt(messages, app.backend.loaded.processor)
    with torch.inference_mode():
        output = app.backend.loaded.model.thinker.generate(
            **model_inputs(app, prompt), max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.3,
            suppress_tokens=app.backend.engine.suppressed_ids,
        )
    expected = [t for t in output[0, prompt.num_tokens :].tolist() if t not in app.backend.engine.eos_ids]
    final = app.session().send(messages[0].text, max_new_tokens=NEW_TOKENS, repetition_penalty=1.3).result()
    assert final.token_ids == expected


def test_an_image_prefill_given_its_deepstack_features_dense_computes_what_the_masked_one_does(demo_settings,
                                                                                               demo_checkpoint):
    """The prefill graphs take DeepStack features as dense rows, zero but at the visual tokens; adding
    zero elsewhere must change nothing, so the graphed prefill of an image computes the eager one.
    Its own app: it takes blocks for two prompts, which the shared app's cached chats may all hold."""
    with OmniLocal(demo_settings) as app:
        _dense_and_masked_prefills_agree(app)


def _dense_and_masked_prefills_agree(app: OmniLocal) -> None:
    runner = app.backend.engine.runner
    prompt = build_prompt([Message("user", [picture(1), "What is in this picture?"])], app.backend.loaded.processor)
    prepared = runner.prepare(prompt, 0, remember=False)
    assert prepared.deepstack is not None
    kv = runner.kv
    tables = [kv.take(kv.shape.blocks_for(prompt.num_tokens)) for _ in range(2)]
    try:
        with torch.inference_mode():
            masked = runner._prefill_step(kv.writer(tables[0], 0), prepared.embeds, prepared.positions,
                                          prepared.visual_mask, prepared.deepstack)
            dense = runner._dense_prefill_step(kv.writer(tables[1], 0), runner._dense_input(prepared),
                                               prepared.positions)
        torch.testing.assert_close(dense, masked, rtol=0, atol=0)
        rows = prompt.num_tokens
        assert torch.equal(kv.to_host(tables[0], rows).kv, kv.to_host(tables[1], rows).kv)
    finally:
        for table in tables:
            kv.pool.release(table)
