"""The Thinking and Captioner checkpoints load, are told apart from Instruct, and answer as
transformers' own `generate` does: Thinking's reasoning streamed apart from its answer and limited
on request, the Captioner's caption of a clip sent alone."""

import json

import numpy as np
import pytest
import soundfile
import torch

from checkpoint_family import write_captioner, write_thinker_only
from replies import NEW_TOKENS, model_inputs, reference_tokens
from samples import clip, picture
from omni_local.api import OmniLocal, ReasoningDelta, TextDelta
from omni_local.cli import DIM, ReasoningPrinter, main
from omni_local.engine.prompt.builder import build_prompt
from omni_local.errors import CheckpointError, RequestError
from omni_local.model import load_model
from omni_local.model.reasoning import reasoning_marks
from omni_local.protocol.kinds import CAPTIONER_TAKES_NO_TEXT, CAPTIONER_TAKES_ONE_CLIP
from omni_local.protocol.messages import Message

QUESTION = "Tell me a story about a lighthouse keeper."
LIMIT = 8  # reasoning tokens, well within NEW_TOKENS


def _marks(app: OmniLocal):
    return reasoning_marks(app.backend.loaded.processor.tokenizer)


def _decode(app: OmniLocal, ids: list[int]) -> str:
    return app.backend.loaded.processor.tokenizer.decode(ids, skip_special_tokens=True)


def _reference_with_limit(app: OmniLocal, messages: list[Message], limit: int) -> list[int]:
    """transformers' greedy reply with its reasoning ended after `limit` tokens: `limit` tokens, then
    `</think>` in the model's input, then the rest, NEW_TOKENS in all."""
    loaded, marks = app.backend.loaded, _marks(app)
    prompt = build_prompt(messages, loaded.processor)
    with torch.inference_mode():
        reasoning = loaded.model.thinker.generate(**model_inputs(app, prompt), max_new_tokens=limit, do_sample=False,
                                                  suppress_tokens=app.backend.engine.suppressed_ids)
        assert marks.end not in reasoning[0, prompt.num_tokens:].tolist(), "the limit must be what ends it"
        ids = torch.cat([reasoning, torch.tensor([[marks.end]], device=reasoning.device)], dim=1)
        whole = loaded.model.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                              max_new_tokens=NEW_TOKENS - limit - 1, do_sample=False,
                                              suppress_tokens=app.backend.engine.suppressed_ids)
    tokens = whole[0, prompt.num_tokens:].tolist()
    eos = app.backend.engine.eos_ids
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


# Telling the members apart


def test_each_member_is_recognised_from_its_talker_and_chat_template(
        demo_settings, demo_model, thinking_checkpoint, captioner_checkpoint):
    assert demo_model.kind == "instruct"
    assert load_model(demo_settings.replace(model=str(thinking_checkpoint))).kind == "thinking"
    assert load_model(demo_settings.replace(model=str(captioner_checkpoint))).kind == "captioner"


def test_the_model_kind_setting_overrides_the_recognition(
        demo_settings, demo_checkpoint, captioner_checkpoint, tmp_path):
    settings = demo_settings.replace(model=str(captioner_checkpoint), model_kind="instruct")
    assert load_model(settings).kind == "instruct"
    text_only = write_thinker_only(demo_checkpoint, tmp_path / "Qwen3-Omni-text-only")
    assert load_model(demo_settings.replace(model=str(text_only), model_kind="captioner")).kind == "captioner"


def test_an_instruct_checkpoint_exported_without_its_talker_is_instruct_and_answers_typed_text(
        demo_settings, demo_checkpoint, tmp_path):
    # Its files are the Captioner's (the Thinker alone, Instruct's template): only the name differs.
    text_only = write_thinker_only(demo_checkpoint, tmp_path / "Qwen3-Omni-30B-A3B-Instruct-text-only")
    with OmniLocal(demo_settings.replace(model=str(text_only))) as app:
        assert (app.info.kind, app.info.speech) == ("instruct", False)
        assert app.session().send(QUESTION, max_new_tokens=2).result().token_ids


def test_the_captioner_is_recognised_in_the_hugging_face_cache_by_its_repository_name(
        demo_settings, demo_checkpoint, tmp_path):
    snapshot = tmp_path / "models--Qwen--Qwen3-Omni-30B-A3B-Captioner" / "snapshots" / "a2bd106cbf52"
    assert load_model(demo_settings.replace(model=str(write_captioner(demo_checkpoint, snapshot)))).kind == "captioner"


def test_speech_on_a_checkpoint_without_a_talker_is_a_clear_error(demo_settings, thinking_checkpoint):
    with pytest.raises(CheckpointError, match="has no Talker .*set speech = false"):
        load_model(demo_settings.replace(model=str(thinking_checkpoint), speech=True))


def test_the_backend_says_which_member_it_serves(thinking, captioner, app):
    assert (thinking.info.kind, captioner.info.kind, app.info.kind) == ("thinking", "captioner", "instruct")
    assert not thinking.info.speech and not captioner.info.speech


def test_the_start_up_line_and_the_page_header_name_the_member(thinking, captioner):
    pytest.importorskip("gradio", reason="the page's header needs the UI's packages")  # not on the GPU machine
    from omni_local.ui.layout import header

    device = thinking.backend.engine.runner.device
    assert thinking.info.describe() == f"Qwen3-Omni Thinking · thinking · float32 on {device} · speech off"
    assert header(captioner).startswith("**omni_local** · Qwen3-Omni Captioner · captioner · ")


# Thinking


def test_a_thinking_reply_equals_transformers_generate(thinking):
    messages = [Message("user", [QUESTION])]
    final = thinking.session().send(QUESTION, max_new_tokens=NEW_TOKENS).result()
    assert final.token_ids == reference_tokens(thinking, messages)


def test_the_reasoning_streams_apart_from_the_answer(thinking):
    reply = thinking.session().send(QUESTION, max_new_tokens=NEW_TOKENS, max_reasoning_tokens=LIMIT)
    events = list(reply)
    final = reply.result()
    reasoning_ids, answer_ids = _marks(thinking).split(final.token_ids, reasoned=True)
    assert len(reasoning_ids) == LIMIT
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == final.reasoning
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == final.text
    assert final.reasoning == _decode(thinking, reasoning_ids)
    assert final.text == _decode(thinking, answer_ids).lstrip()
    kinds = [type(e) for e in events if isinstance(e, ReasoningDelta | TextDelta)]
    assert kinds == sorted(kinds, key=lambda kind: kind is TextDelta), "every reasoning delta comes first"


def test_the_reasoning_limit_ends_the_block_as_transformers_would_with_the_marker_written_in(thinking):
    final = thinking.session().send(QUESTION, max_new_tokens=NEW_TOKENS, max_reasoning_tokens=LIMIT).result()
    assert final.token_ids == _reference_with_limit(thinking, [Message("user", [QUESTION])], LIMIT)


def test_a_reply_that_stops_while_reasoning_is_all_reasoning(thinking):
    final = thinking.session().send(QUESTION, max_new_tokens=6).result()
    assert final.text == "" and final.reasoning == _decode(thinking, final.token_ids)


def test_turn_two_leaves_turn_ones_reasoning_out_as_the_template_does_and_reuses_its_prompt(thinking):
    session = thinking.session()
    # A question no other test asks: in any order, the cache holds no conversation that begins with it.
    question = "Tell me a story about a lighthouse keeper's cat."
    first = session.send(question, max_new_tokens=NEW_TOKENS, max_reasoning_tokens=LIMIT).result()
    second = session.send("And then?", max_new_tokens=NEW_TOKENS, max_reasoning_tokens=LIMIT).result()
    marks = _marks(thinking)
    prompt = build_prompt(session.history[:-1], thinking.backend.loaded.processor, marks).input_ids[0].tolist()
    assert prompt.count(marks.end) == 0 and prompt.count(marks.start) == 1  # the generation prompt's own
    # Turn one's prompt up to its reply's "<think>\n", which turn two's does not hold there.
    assert second.tokens.reused == first.tokens.prompt - 2
    assert second.tokens.computed == second.tokens.prompt - second.tokens.reused


def test_a_thinking_chat_answers_the_same_with_every_cache_off(thinking, demo_settings, thinking_checkpoint):
    def chat(app: OmniLocal) -> list[list[int]]:
        session = app.session()
        return [session.send(q, max_new_tokens=NEW_TOKENS, max_reasoning_tokens=LIMIT).result().token_ids
                for q in (QUESTION, "And then?", "Why?")]

    cold = demo_settings.replace(model=str(thinking_checkpoint), prefix_cache=False, encoder_cache=False)
    with OmniLocal(cold) as uncached:
        assert chat(thinking) == chat(uncached)


# The Captioner


def test_a_caption_equals_transformers_generate(captioner):
    sound = clip(5, 2.0)
    final = captioner.session().send(audio=[sound], max_new_tokens=NEW_TOKENS).result()
    assert final.token_ids == reference_tokens(captioner, [Message("user", [sound])])
    assert final.reasoning == ""


def test_each_clip_is_captioned_on_its_own(captioner):
    session = captioner.session()
    first = session.send(audio=[clip(6, 2.0)], max_new_tokens=NEW_TOKENS).result()
    second = session.send(audio=[clip(6, 2.0)], max_new_tokens=NEW_TOKENS).result()
    assert second.token_ids == first.token_ids and second.tokens.prompt == first.tokens.prompt


@pytest.mark.parametrize("send, message", [
    (lambda s: s.send("Describe it.", audio=[clip(7, 1.0)]), CAPTIONER_TAKES_NO_TEXT),
    (lambda s: s.send("Describe it."), CAPTIONER_TAKES_NO_TEXT),
    (lambda s: s.send(images=[picture(1)]), CAPTIONER_TAKES_ONE_CLIP),
    (lambda s: s.send(audio=[clip(7, 1.0), clip(8, 1.0)]), CAPTIONER_TAKES_ONE_CLIP),
], ids=["text with a clip", "text alone", "an image", "two clips"])
def test_the_captioner_refuses_what_is_not_one_clip_alone_saying_why(captioner, send, message):
    session = captioner.session()
    with pytest.raises(RequestError, match=message.split(":")[0]):
        send(session)
    assert session.history == []
    assert session.send(audio=[np.asarray(clip(9, 1.0))], max_new_tokens=4).result().token_ids


# The command line


def _flags(checkpoint, demo_settings) -> list[str]:
    return ["--model", str(checkpoint), "--cache-dir", demo_settings.cache_dir, "--device", "cpu",
            "--max-new-tokens", str(NEW_TOKENS)]


def test_ask_prints_the_reasoning_only_when_asked_where_the_output_is_no_terminal(
        thinking_checkpoint, demo_settings, capsys):
    flags = [*_flags(thinking_checkpoint, demo_settings), "--max-reasoning-tokens", str(LIMIT)]
    assert main(["ask", QUESTION, "--json", *flags]) == 0
    final = json.loads(capsys.readouterr().out)
    assert main(["ask", QUESTION, *flags]) == 0
    hidden = capsys.readouterr().out
    assert main(["ask", QUESTION, "--show-reasoning", *flags]) == 0
    shown = capsys.readouterr().out
    assert final["reasoning"] and final["reasoning"] not in hidden
    assert shown.startswith(f"Reasoning:\n{final['reasoning']}\n\n{final['text']}\n")
    assert hidden.startswith(f"{final['text']}\n")


def test_on_a_terminal_the_reasoning_is_dimmed_and_the_answer_is_not(capsys):
    printer = ReasoningPrinter(shown=True, dim=True)
    printer.print("Let me see.")
    printer.end()
    assert capsys.readouterr().out == f"{DIM}Let me see.\x1b[0m\n\n"


def test_ask_captions_an_audio_file_given_alone(captioner_checkpoint, demo_settings, tmp_path, capsys):
    sound = clip(5, 2.0)
    soundfile.write(tmp_path / "sound.wav", sound, 16_000)
    assert main(["ask", "--audio", str(tmp_path / "sound.wav"), "--json", *_flags(captioner_checkpoint,
                                                                                  demo_settings)]) == 0
    final = json.loads(capsys.readouterr().out)
    assert final["text"] and final["tokens"]["generated"] == len(final["token_ids"])


def test_ask_with_a_question_for_the_captioner_ends_with_the_reason_and_status_2(
        captioner_checkpoint, demo_settings, tmp_path, capsys):
    soundfile.write(tmp_path / "sound.wav", clip(5, 2.0), 16_000)
    flags = _flags(captioner_checkpoint, demo_settings)
    assert main(["ask", "What is this?", "--audio", str(tmp_path / "sound.wav"), *flags]) == 2
    assert capsys.readouterr().err == f"error: {CAPTIONER_TAKES_NO_TEXT}\n"
