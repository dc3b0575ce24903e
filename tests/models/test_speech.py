"""Spoken replies: the Talker's codes are transformers' own, the audio streams while the text does,
the prefix cache never changes what is said, a reply that calls a tool is spoken up to the call and
no further, and a bad request for speech is a clear error."""

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chats import SpokenChat, written
from forced_replies import forced_replies
from device_under_test import TEST_DEVICE
from replies import GREEDY, NEW_TOKENS, media, send, transformers_speech
from samples import QUESTIONS, clip, picture
from waiting import until
from omni_local.api import AudioChunk, OmniLocal
from omni_local.engine.forward.talker import OPENING_ROWS
from omni_local.engine.forward.vocoder import AudioStream, Vocoder
from omni_local.engine.prompt.builder import build_prompt
from omni_local.errors import RequestError
from omni_local.metrics_line import metrics_line
from omni_local.protocol.functions import Tool
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams
from omni_local.protocol.tools import REQUIRED_PREFIX

SPEECH_SECONDS = 2.0  # 25 frames: every reply here is cut there (the demo's random Talker rarely ends)
END = "<|im_end|>"
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
WEATHER = Tool("get_weather", "The weather in a city, now.",
               {"type": "object", "properties": {"city": {"type": "string"}}})


@pytest.fixture(scope="module")
def speaking_apps(demo_settings, demo_checkpoint):
    """conftest's `apps` with speech: the demo model twice, with every cache and with every cache off."""
    on = demo_settings.replace(speech=True, max_speech_seconds=SPEECH_SECONDS)
    off = on.replace(prefix_cache=False, encoder_cache=False)
    with OmniLocal(on) as cached, OmniLocal(off) as uncached:
        yield cached, uncached


def one_decode(code2wav: torch.nn.Module, codes: torch.Tensor) -> np.ndarray:
    """The waveform of codes [groups, frames] decoded at once, on Code2Wav's device."""
    with torch.inference_mode():
        return code2wav(codes.to(next(code2wav.parameters()).device)[None])[0, 0].cpu().numpy()


@pytest.mark.parametrize("case", QUESTIONS)
def test_spoken_replies_have_the_codes_and_audio_of_transformers_generate(speaking_apps, case):
    app = speaking_apps[1]
    parts = QUESTIONS[case]()
    final, frames, audio, _ = send(app, app.session(), parts[-1], voice="Chelsie", **media(parts))
    text, codes = transformers_speech(app, [Message("user", parts)], "Chelsie")
    assert final.token_ids == text and len(text) > 1
    assert frames == codes.T.tolist() and len(frames) == final.speech.frames
    # Every chunk here had its whole reply as left context (25 frames, the default), so the stream
    # equals one decode of all the codes to float rounding; the chunking's own error is measured below.
    # On a GPU that rounding is coarser: cuDNN convolutions run in TF32 and choose their algorithm by
    # length (measured up to 1.4e-5 on an H200, peaks about 0.05).
    whole = one_decode(app.backend.loaded.model.code2wav, codes)
    assert audio.shape == whole.shape
    np.testing.assert_allclose(audio, whole, atol=1e-6 if app.backend.loaded.device.type == "cpu" else 5e-5)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a forward hook does not run inside a replayed CUDA graph")
def test_a_talker_that_ends_its_speech_keeps_the_frames_before_the_end_as_transformers_generate(speaking_apps):
    # The engine completes a frame before the host reads its first code, so the frame whose first
    # code ends the speech is made, then dropped. Here the Talker's codec head votes for the end from
    # its fourth forward on (the first is the prompt's): three frames are spoken.
    app = speaking_apps[1]
    talker, end = app.backend.loaded.model.talker, app.backend.loaded.model.config.talker_config.codec_eos_token_id
    forwards = 0

    def end_from_the_fourth(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return logits.index_fill(-1, torch.tensor([end], device=logits.device), 100.0) if forwards >= 4 else logits

    handle = talker.codec_head.register_forward_hook(end_from_the_fourth)
    try:
        final, frames, audio, _ = send(app, app.session(), "Tell me about the sea.", voice="Chelsie")
        forwards = 0
        text, codes = transformers_speech(app, [Message("user", ["Tell me about the sea."])], "Chelsie")
    finally:
        handle.remove()
    assert len(frames) == final.speech.frames == 3 and audio.size > 0
    assert frames == codes.T.tolist() and final.token_ids == text
    assert len(send(app, app.session(), "And about the sky?", voice="Chelsie")[1]) > 3  # the next reply speaks on


def test_chunks_with_less_left_context_than_the_reply_stay_close_to_one_decode(speaking_apps):
    code2wav = speaking_apps[0].backend.loaded.model.code2wav
    frames = torch.randint(0, 64, (120, 4), generator=torch.Generator().manual_seed(0)).tolist()
    vocoder, stream = Vocoder(code2wav, first_chunk=2, chunk=10, left_context=25), AudioStream()
    chunks = []
    for frame in frames:
        stream.frames.append(frame)
        if vocoder.due(stream, final=False):
            chunks.append(vocoder.decode(stream))
    if vocoder.due(stream, final=True):
        chunks.append(vocoder.decode(stream))
    whole = one_decode(code2wav, torch.tensor(frames).T)
    streamed = np.concatenate(chunks)
    assert [len(c) // vocoder.samples_per_frame for c in chunks[:5]] == [1, 4, 8, 10, 10]  # 2, 4, 8, 10 frames
    assert streamed.shape == whole.shape  # no gap and no overlap at the 13 chunk boundaries
    # Past 25 frames of context a chunk no longer sees what Code2Wav's sliding-window attention
    # (72 frames) and its convolutions would reach: the demo's waveform then differs by under 2% of
    # its peak (measured 1.2%); with 200 frames of context the difference was 6e-8.
    assert np.abs(streamed - whole).max() < 0.02 * np.abs(whole).max()


def test_a_chunk_padded_on_the_right_decodes_to_the_samples_of_the_chunk_alone(speaking_apps):
    """What lets a CUDA graph of a longer chunk decode a shorter one: Code2Wav is causal up to its
    right edge, so frames after a chunk change none of its samples, only add their own."""
    code2wav = speaking_apps[0].backend.loaded.model.code2wav
    frames_per_graph, per_frame = 35, int(code2wav.total_upsample)
    codes = torch.randint(0, code2wav.config.codebook_size, (1, code2wav.config.num_quantizers, frames_per_graph),
                          generator=torch.Generator().manual_seed(1)).to(speaking_apps[0].backend.loaded.device)
    with torch.inference_mode():
        for frames in (1, 2, 13, 34):
            alone = code2wav(codes[..., :frames])
            zeros = codes.clone()
            zeros[..., frames:] = 0
            for padded in (codes, zeros):  # padded with later frames, and with code 0
                wav = code2wav(padded)
                assert wav.shape[-1] - (frames_per_graph - frames) * per_frame == alone.shape[-1]
                # Not bit-exact: kernels of another length round differently (measured up to 7e-8 on
                # the CPU; on a GPU, cuDNN's TF32 convolutions choose their algorithm by length).
                atol = 1e-6 if code2wav.device.type == "cpu" else 5e-5
                torch.testing.assert_close(wav[..., : alone.shape[-1]], alone, atol=atol, rtol=0)


def test_every_chunk_of_a_stream_fits_a_length_graphs_are_captured_for(speaking_apps):
    code2wav = speaking_apps[0].backend.loaded.model.code2wav
    vocoder, stream = Vocoder(code2wav, first_chunk=2, chunk=10, left_context=25), AudioStream()
    decode, lengths = vocoder.code2wav, []

    def recording(codes: torch.Tensor) -> torch.Tensor:
        lengths.append(codes.shape[-1])
        return decode(codes)

    vocoder.code2wav = recording
    for frame in torch.randint(0, 64, (61, 4), generator=torch.Generator().manual_seed(2)).tolist():
        stream.frames.append(frame)
        if vocoder.due(stream, final=False):
            vocoder.decode(stream)
    vocoder.decode(stream)  # the last 7 frames after 25 of context
    assert vocoder.chunk_lengths() == [2, 6, 14, 24, 34, 35]
    assert lengths == [2, 6, 14, 24, 34, 35, 35, 32]


def test_the_first_audio_arrives_while_the_text_is_still_streaming(speaking_apps):
    app = speaking_apps[0]
    final, _, audio, order = send(app, app.session(), "Tell me a story about a lighthouse keeper.", max_new_tokens=40)
    assert final.tokens.generated == 40, "the comparison needs a 40-token reply"
    last_text = len(order) - 1 - order[::-1].index("T")
    assert order.index("A") < last_text
    assert final.speech.first_audio_s > 0 and final.speech.audio_s == pytest.approx(audio.size / 24_000)
    assert final.speech.real_time_factor > 0 and "real-time factor" in metrics_line(final)


def test_a_voice_chat_turn_2_computes_only_its_new_tokens_and_says_the_same(speaking_apps):
    chat = SpokenChat(speaking_apps, "You speak.")
    first = chat.send("Hello, who are you?")
    second = chat.send("And what do you like?")
    assert second.tokens.computed == second.tokens.prompt - written(first)
    # The Talker's prompt holds the user turns only: turn 1's rows (all but its assistant rows) are reused.
    assert second.speech.talker_reused == first.speech.talker_prompt - OPENING_ROWS


@pytest.mark.parametrize("kind", ["images", "audio"])
def test_a_spoken_answer_to_a_known_medium_reuses_it_and_says_the_same(speaking_apps, kind):
    medium = {kind: [picture(7) if kind == "images" else clip(8)]}
    SpokenChat(speaking_apps, "You look and listen.").send("What is this?", **medium)
    final = SpokenChat(speaking_apps, "You look and listen.").send("Tell me more.", **medium)
    prompt = build_prompt([Message("system", ["You look and listen."]),
                           Message("user", [*medium[kind], "Tell me more."])], speaking_apps[0].backend.loaded.processor)
    assert final.tokens.reused_gpu >= prompt.media[0].end  # the medium came from the cache, Talker rows too


def test_a_known_medium_after_another_system_prompt_is_spoken_as_without_the_cache(speaking_apps):
    """A medium's Talker rows come from the Thinker's hidden states, which the system prompt before
    it changes: the Talker KV of a chat that sent the same clip after another system prompt must
    not be reused."""
    SpokenChat(speaking_apps, "You look and listen.").send("What is this?", audio=[clip(10)])
    second = SpokenChat(speaking_apps, "You are a pirate who hears everything.").send("What is this?", audio=[clip(10)])
    assert second.media.from_cache == 1, "the clip must be known, or this shows nothing"
    # The Thinker prompts part in the system turn, before the first user row: nothing is reused.
    assert second.speech.talker_reused == 0


def test_a_text_turn_then_a_spoken_turn_reads_the_rows_the_text_turn_cached(speaking_apps):
    chat = SpokenChat(speaking_apps, "You answer.")
    first, _ = (session.send("Look at this.", images=[picture(9)], max_new_tokens=NEW_TOKENS).result()
                for session in chat.sessions)
    second = chat.send("What did you see?")
    assert second.tokens.computed == second.tokens.prompt - written(first)


def test_replies_speaking_at_once_take_each_talker_step_and_frame_together_and_each_speaks_as_it_would_alone(
        speaking_apps, monkeypatch):
    app = speaking_apps[1]
    questions = ["Tell me about the sea.", "What do owls eat?", "Sing of the harbour at night."]
    alone = [send(app, app.session(), question) for question in questions]
    runner, steps, frames = app.backend.engine.speaker.runner, [], []
    step, frame = runner.steps, runner.complete_frames
    monkeypatch.setattr(runner, "steps", lambda tables, *rest: steps.append(len(tables)) or step(tables, *rest))
    monkeypatch.setattr(runner, "complete_frames",
                        lambda hidden, *rest: frames.append(len(hidden)) or frame(hidden, *rest))
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda question: send(app, app.session(), question), questions))
    assert max(steps) == len(questions), "the replies speaking at once must step together"
    assert max(frames) == len(questions), "their code predictor's frames must be one batch too"
    for (final, frames, audio, _), (final_alone, frames_alone, audio_alone, _) in zip(together, alone):
        assert frames, "the reply must speak, or the comparison proves little"
        assert final.token_ids == final_alone.token_ids and frames == frames_alone
        np.testing.assert_allclose(audio, audio_alone, atol=1e-6 if TEST_DEVICE == "cpu" else 5e-5)


def test_a_frame_of_several_replies_computed_as_one_batch_has_the_codes_of_each_reply_alone(
        speaking_apps, monkeypatch):
    """What the frames' graphs capture on a GPU, run eagerly here: three replies' frames (greedy and
    sampled, at other frames) in one forward of a batch of four, the fourth row padding."""
    runner = speaking_apps[1].backend.engine.speaker.runner
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 1, runner.stack.config.hidden_size, generator=generator).to(runner.device, runner.dtype)
    firsts = torch.tensor([5, 17, 300], device=runner.device)
    args = ([SamplingParams(), SamplingParams(temperature=1.0, top_k=50, top_p=0.8), SamplingParams()],
            [1, 2, 3], [0, 4, 9])  # params, seeds, frames
    alone = [runner.complete_frames(hidden[i : i + 1], firsts[i : i + 1], *(arg[i : i + 1] for arg in args))
             for i in range(3)]
    as_graphs = {size: SimpleNamespace(replay=partial(runner._frame, sampling=True)) for size in (1, 2, 4)}
    monkeypatch.setattr(runner, "frame_graphs", as_graphs)
    codes, sums = runner.complete_frames(hidden, firsts, *args)
    assert [frame.tolist() for frame in codes] == [frame[0].tolist() for frame, _ in alone]
    torch.testing.assert_close(sums, torch.cat([summed for _, summed in alone]))


def test_cancel_stops_text_and_speech_at_once_and_sends_only_whole_chunks(speaking_apps, monkeypatch):
    app = speaking_apps[0]
    speaker, held = app.backend.engine.speaker, {}
    frame_out = speaker.frame_out

    def frame_out_then_cancel(reply):
        chunk = frame_out(reply)
        if chunk is not None:  # cancel in the worker right after the first chunk: a known point
            until(lambda: "reply" in held, "the reply must be sent")
            held["reply"].cancel()
        return chunk

    monkeypatch.setattr(speaker, "frame_out", frame_out_then_cancel)
    question = "Tell me a story about a lighthouse keeper."
    held["reply"] = reply = app.session().send(question, max_new_tokens=NEW_TOKENS, **GREEDY)
    chunks = [event for event in reply if isinstance(event, AudioChunk)]
    final = reply.result()
    assert final.stop_reason == "cancelled" and final.tokens.generated < NEW_TOKENS
    assert len(chunks) == 1 and final.speech.frames == len(chunks[0].frames)  # no frame after the cancel
    # The chunk is the audio of whole frames: exactly what those frames decode to, nothing cut.
    whole = one_decode(app.backend.loaded.model.code2wav, torch.tensor(chunks[0].frames).T)
    assert reply.audio.shape == whole.shape
    monkeypatch.undo()
    again, frames, _, _ = send(app, app.session(), "Are you there?")
    assert again.stop_reason != "cancelled" and frames


def test_a_sampled_spoken_reply_is_the_same_again_with_its_seed_and_another_seed_differs(speaking_apps):
    sampled = {"temperature": 0.9, "top_k": 50, "talker_temperature": 0.9, "seed": 7}  # text and speech sampled
    replies = [send(speaking_apps[1], speaking_apps[1].session(), "Sing me something.", **options)
               for options in (sampled, sampled, {**sampled, "seed": 8})]
    (first, frames, audio, _), (again, frames_again, audio_again, _), (other, other_frames, _, _) = replies
    assert frames, "the reply must speak, or the comparison proves little"
    assert again.token_ids == first.token_ids and frames_again == frames and np.array_equal(audio_again, audio)
    assert (other.token_ids, other_frames) != (first.token_ids, frames)


def test_an_unknown_voice_is_an_error_listing_the_voices_and_the_next_request_is_served(speaking_apps):
    app = speaking_apps[0]
    with pytest.raises(RequestError, match="unknown voice 'Nobody'.*Aiden, Chelsie, Ethan"):
        app.session().send("Hi", speak=True, voice="Nobody")
    assert send(app, app.session(), "Hi", voice="aiden")[1]


def test_speech_from_an_app_without_the_talker_is_an_error_and_the_next_request_is_served(app):
    with pytest.raises(RequestError, match="speech = true"):
        app.session().send("Hi", speak=True)
    assert app.session().send("Hi", max_new_tokens=4).result().token_ids


def test_a_reply_without_speech_has_no_audio(speaking_apps):
    reply = speaking_apps[0].session().send("Hi", max_new_tokens=4)
    final = reply.result()
    assert final.speech is None and reply.audio.size == 0


@pytest.mark.parametrize(("call", "calls"), [(PARIS, ["get_weather"]), (BROKEN, [])], ids=["call", "broken call"])
def test_a_reply_that_opens_a_call_is_spoken_as_the_same_reply_ended_where_the_call_opens(speaking_apps, call, calls):
    # The Talker reads text-EOS where the call opens, as where the end of turn is: the same speech. Had
    # it read the call's tokens, the frames from there on would differ.
    app = speaking_apps[0]
    with forced_replies(app.backend.engine, app.backend.loaded.processor.tokenizer, f"I will check. {call}{END}",
                        f"I will check. {END}"):
        called, called_frames, called_audio, _ = send(app, app.session(), "Weather?", tools=[WEATHER],
                                                      max_new_tokens=64)
        spoken, frames, audio, _ = send(app, app.session(), "Weather?")
    assert [c.name for c in called.tool_calls] == calls and (call in called.text) == (not calls)
    assert called.stop_reason == "end_of_turn" and len(frames) == called.speech.frames > 6
    assert called_frames == frames and np.array_equal(called_audio, audio)


@pytest.mark.parametrize(("choice", "reply"), [("auto", PARIS), ("required", PARIS.removeprefix(REQUIRED_PREFIX))])
def test_a_spoken_reply_that_begins_with_a_call_has_no_audio_and_ends(speaking_apps, choice, reply):
    app = speaking_apps[0]
    with forced_replies(app.backend.engine, app.backend.loaded.processor.tokenizer, reply + END):
        final, frames, audio, _ = send(app, app.session(), "Weather?", tools=[WEATHER], tool_choice=choice,
                                       max_new_tokens=64)
    assert [call.name for call in final.tool_calls] == ["get_weather"] and final.stop_reason == "end_of_turn"
    assert final.speech is None and frames == [] and audio.size == 0


def test_a_spoken_reply_with_tools_is_refused_where_the_tokenizer_has_no_single_call_opening(
        speaking_apps, monkeypatch):
    app = speaking_apps[0]
    monkeypatch.setattr(app.backend.engine, "call_open", None)  # as a tokenizer spelling <tool_call> in pieces
    with pytest.raises(RequestError, match="no single <tool_call> token"):
        app.session().send("Weather?", speak=True, tools=[WEATHER])
    assert app.session().send("Weather?", tools=[WEATHER], max_new_tokens=4).result().stop_reason


def test_a_reply_whose_text_goes_on_after_its_speech_ends_gives_the_talkers_blocks_back_when_the_speech_ends(
        speaking_apps, monkeypatch):
    # A call's arguments written long after the spoken words: the speech ends at its last frame
    # (SPEECH_SECONDS), the text some turns later. Without the cache, nothing of the Talker's is kept.
    app = speaking_apps[1]
    engine, pool = app.backend.engine, app.backend.engine.speaker.runner.kv.pool
    held_as_text_ended, end_text = [], engine.endings.end_text
    monkeypatch.setattr(engine.endings, "end_text", lambda request, reason: held_as_text_ended.append(pool.held)
                        or end_text(request, reason))
    long_call = PARIS.replace('"Paris"', '"Paris", "note": "' + "rain " * 10 + '"')
    with forced_replies(engine, app.backend.loaded.processor.tokenizer, f"I will check. {long_call}{END}"):
        final, frames, _, _ = send(app, app.session(), "Weather?", tools=[WEATHER], max_new_tokens=128)
    assert [c.name for c in final.tool_calls] == ["get_weather"], (final.stop_reason, final.text)
    assert len(frames) < final.tokens.generated  # the speech ended first
    assert held_as_text_ended == [0]
