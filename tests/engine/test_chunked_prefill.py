"""While another reply is decoding or speaking, a prompt is computed in chunks at fixed positions, one
per engine turn; with none, in one forward. In chunks it gives the tokens of one whole forward and
of transformers' own; a medium across a boundary is encoded once; a chat decoding gets a token
between every two chunks, and once it is done the rest is one forward from the boundary reached; a
prefill cut short leaves its session's entry as it was. Short prompts waiting together beside a
decoding reply are prefilled several in a turn's forward, as long as it stays within one chunk's tokens.

(Most apps here chunk every prefill, `chunk_every_prefill`: a test of what the chunks compute then
needs no other chat decoding beside it.)
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch

from chats import Chat, written
from replies import GREEDY, media, reference_tokens
from samples import clip, picture
from omni_local.api import AudioChunk, OmniLocal, TextDelta
from omni_local.engine.prompt.builder import build_prompt
from omni_local.errors import RequestError
from omni_local.protocol.messages import Message

CHUNK = 16
SYSTEM = "You are a helpful assistant."
LONG = " ".join(f"Rule {i}: answer the sailor plainly." for i in range(12))  # about 200 tokens
CASES = {
    "text": lambda: [LONG],
    "image": lambda: [picture(1), "What is in this picture?"],  # its 20 tokens hold the boundary at 32
    "224x224 image and audio": lambda: [picture(3, (224, 224)), clip(4, 3.0), "Describe both."],
}


@pytest.fixture(scope="module")
def chunking(demo_settings, demo_checkpoint) -> Iterator[tuple[OmniLocal, OmniLocal]]:
    """The demo twice, every cache off, chunks of CHUNK tokens: in chunks always, and only beside
    another reply (the default)."""
    off = demo_settings.replace(prefix_cache=False, encoder_cache=False, prefill_chunk_tokens=CHUNK)
    with OmniLocal(off.replace(chunk_every_prefill=True)) as always, OmniLocal(off) as beside:
        yield always, beside


@pytest.fixture(scope="module")
def chunking_apps(make_apps, demo_settings) -> tuple[OmniLocal, OmniLocal]:
    """conftest's `apps`, every cache on and every cache off, chunking every prefill at CHUNK tokens."""
    return make_apps(demo_settings.replace(prefill_chunk_tokens=CHUNK, chunk_every_prefill=True))


def chunk_bounds(start: int, prompt_end: int) -> list[tuple[int, int]]:
    """The (begin, end) rows of each chunk of a tail from row `start`: every boundary a multiple of CHUNK."""
    edges = [start, *range((start // CHUNK + 1) * CHUNK, prompt_end, CHUNK), prompt_end]
    return list(zip(edges, edges[1:]))


@contextmanager
def forwards_of(app: OmniLocal, decodes: bool = False) -> Iterator[list]:
    """Meanwhile, in order, the (begin, end) rows of every prefill forward the app computes (a list of
    them for a forward of several prompts), and with `decodes` a "decode" for every decode step."""
    runner, calls = app.backend.engine.runner, []
    prefill, together, decode = runner.prefill, runner.prefill_together, runner.decode

    def recording_prefill(table, prepared):
        calls.append((prepared.start, prepared.end))
        return prefill(table, prepared)

    def recording_together(parts):
        calls.append([(prepared.start, prepared.end) for _, prepared in parts])
        return together(parts)

    def recording_decode(*args):
        if decodes:
            calls.append("decode")
        return decode(*args)

    with (patch.object(runner, "prefill", recording_prefill), patch.object(runner, "prefill_together", recording_together),
          patch.object(runner, "decode", recording_decode)):
        yield calls


@pytest.mark.parametrize("case", CASES)
def test_a_prompt_in_chunks_gives_the_tokens_of_one_whole_forward_and_of_transformers(chunking, case):
    parts = CASES[case]()
    finals, forwards = [], []
    for app in chunking:
        with forwards_of(app) as calls:
            finals.append(app.session(SYSTEM).send(parts[-1], **media(parts), max_new_tokens=12).result())
        forwards.append(calls)
    prompt = finals[0].tokens.prompt
    assert forwards == [chunk_bounds(0, prompt), [(0, prompt)]] and len(forwards[0]) > 2
    assert finals[0].token_ids == finals[1].token_ids
    assert finals[0].token_ids, "the reply must not be empty, or the comparison proves little"
    messages = [Message("system", [SYSTEM]), Message("user", parts)]
    assert finals[0].token_ids == reference_tokens(chunking[0], messages)[:12]


def test_a_long_prompt_with_no_other_reply_running_is_prefilled_in_one_forward(chunking):
    app = chunking[1]
    with forwards_of(app) as calls:
        final = app.session(SYSTEM).send(LONG, max_new_tokens=4).result()
    assert final.tokens.prompt > 10 * CHUNK
    assert calls == [(0, final.tokens.prompt)]


def test_a_prompt_alone_longer_than_one_forward_is_cut_at_its_multiples_and_gives_the_same_tokens(chunking,
                                                                                                 demo_settings):
    forward = 4 * CHUNK
    settings = demo_settings.replace(prefix_cache=False, encoder_cache=False, prefill_chunk_tokens=CHUNK,
                                     prefill_forward_tokens=forward)
    with OmniLocal(settings) as app, forwards_of(app) as calls:
        final = app.session(SYSTEM).send(LONG, max_new_tokens=12).result()
    whole = chunking[1].session(SYSTEM).send(LONG, max_new_tokens=12).result()
    edges = [*range(0, final.tokens.prompt, forward), final.tokens.prompt]
    assert len(edges) > 3 and calls == list(zip(edges, edges[1:]))
    assert final.token_ids == whole.token_ids


def test_an_image_across_chunk_boundaries_is_encoded_once_and_its_deepstack_rows_are_split_between_them(chunking):
    app = chunking[0]
    parts = [picture(3, (224, 224)), "What is in this picture?"]
    prompt = build_prompt([Message("user", parts)], app.backend.loaded.processor)
    image = prompt.media[0]
    assert image.start // CHUNK < (image.end - 1) // CHUNK - 1, "the image must span more than two chunks"
    runner = app.backend.engine.runner
    prepared = runner.prepare(prompt, 0, remember=False)
    parts_of = [prepared.rows(begin, end) for begin, end in chunk_bounds(0, prompt.num_tokens)]
    for level, whole in enumerate(prepared.deepstack):
        split = torch.cat([p.deepstack[level] for p in parts_of if p.deepstack is not None])
        assert torch.equal(split, whole)
    device = prepared.visual_mask.device  # the ids stay on the host
    masks = [p.visual_mask if p.visual_mask is not None else torch.zeros(p.ids.shape, dtype=torch.bool, device=device)
             for p in parts_of]
    assert torch.equal(torch.cat(masks, dim=1), prepared.visual_mask)

    encoders = runner.encoder.encoders
    with patch.object(encoders, "images", wraps=encoders.images) as encoded:
        final = app.session().send(parts[1], images=[parts[0]], max_new_tokens=12).result()
    assert encoded.call_count == 1 and final.media.encoded == 1
    assert final.token_ids, "the reply must not be empty, or the comparison proves little"
    assert final.token_ids == reference_tokens(app, [Message("user", parts)])[:12]


def test_a_tail_on_a_cached_prefix_runs_to_the_next_multiple_of_the_chunk_then_in_whole_chunks(chunking_apps):
    chat = Chat(chunking_apps, SYSTEM)
    first = chat.send("Tell me about the lighthouse keeper.")
    with forwards_of(chunking_apps[0]) as calls:
        second = chat.send(LONG)
    start, end = written(first), second.tokens.prompt
    assert second.tokens.reused_gpu == start and start % CHUNK
    assert calls == chunk_bounds(start, end)
    assert calls[0][1] == (start // CHUNK + 1) * CHUNK and all(b % CHUNK == 0 for b, _ in calls[1:])


def test_a_chat_decoding_gets_a_token_between_every_two_chunks_of_a_long_prompt(chunking, monkeypatch):
    app = chunking[1]
    monkeypatch.setattr(app.backend.engine, "eos_ids", set())  # the decoding chat runs to its last token
    with forwards_of(app, decodes=True) as order:
        steady = app.session().send("Tell me about the tide.", max_new_tokens=120)
        next(event for event in steady if isinstance(event, TextDelta))  # it decodes now
        long = app.session().send(LONG, max_new_tokens=4).result()
        steady_tokens = steady.result().token_ids

    chunks = chunk_bounds(0, long.tokens.prompt)
    first = order.index(chunks[0])
    assert order[first : first + 2 * len(chunks) - 1] == [step for chunk in chunks for step in (chunk, "decode")][:-1]
    assert steady_tokens == app.session().send("Tell me about the tide.", max_new_tokens=120).result().token_ids


def test_a_long_prompts_first_token_is_read_after_the_decode_step_queued_beside_its_last_chunk(chunking, monkeypatch):
    # Read at once, the first token would hold the decoding chat's next token back by the last chunk
    # too, and by the host's work on it (publishing the prompt's rows).
    app = chunking[1]
    engine = app.backend.engine
    monkeypatch.setattr(engine, "eos_ids", set())  # the decoding chat runs until stopped
    with forwards_of(app, decodes=True) as order:
        first_token = engine._first_token

        def recording_first_token(request, choice):
            order.append("first token")
            return first_token(request, choice)

        monkeypatch.setattr(engine, "_first_token", recording_first_token)
        steady = app.session().send("Tell me about the tide.", max_new_tokens=400)
        next(event for event in steady if isinstance(event, TextDelta))  # it decodes now
        long = app.session().send(LONG, max_new_tokens=4).result()
        steady.cancel()
    assert steady.result().stop_reason == "cancelled"

    last = chunk_bounds(0, long.tokens.prompt)[-1]
    at = order.index(last)
    assert order[at : at + 3] == [last, "decode", "first token"]


def test_a_prompt_begun_in_chunks_beside_a_reply_that_then_stops_ends_in_one_forward_from_a_boundary(
    chunking, monkeypatch
):
    app = chunking[1]
    runner = app.backend.engine.runner
    monkeypatch.setattr(app.backend.engine, "eos_ids", set())  # the decoding chat runs until stopped
    steady = app.session().send("Tell me about the tide.", max_new_tokens=400)
    next(event for event in steady if isinstance(event, TextDelta))  # it decodes now
    prefill, calls = runner.prefill, []

    def stopping_the_other_after_two_chunks(table, prepared):
        calls.append((prepared.start, prepared.end))
        if len(calls) == 2:
            steady.cancel()  # it ends at the next turn's start, before that turn's prefill
        return prefill(table, prepared)

    monkeypatch.setattr(runner, "prefill", stopping_the_other_after_two_chunks)
    long = app.session().send(LONG, max_new_tokens=6).result()
    monkeypatch.setattr(runner, "prefill", prefill)
    assert steady.result().stop_reason == "cancelled"

    assert calls == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, long.tokens.prompt)]
    assert long.token_ids == app.session().send(LONG, max_new_tokens=6).result().token_ids  # alone: one forward


def test_a_prompt_sent_while_another_reply_is_still_speaking_is_computed_in_chunks(demo_settings):
    settings = demo_settings.replace(speech=True, max_speech_seconds=30.0, prefill_chunk_tokens=CHUNK,
                                     prefix_cache=False, encoder_cache=False)
    with OmniLocal(settings) as app:
        # Two reply tokens, then speech for as long as the demo's Talker goes on (rarely ending on its own).
        spoken = app.session().send("Tell me about the tide.", max_new_tokens=2, **GREEDY, voice="Chelsie")
        chunks = (event for event in spoken if isinstance(event, AudioChunk))
        next(chunks), next(chunks)  # six frames in: its text is done, its speech is not
        with forwards_of(app) as calls:
            long = app.session().send(LONG, max_new_tokens=4).result()
        spoken.cancel()
        assert spoken.result().tokens.generated == 2 and spoken.result().stop_reason == "cancelled"
    assert calls == chunk_bounds(0, long.tokens.prompt)


def test_a_prefill_cancelled_between_its_chunks_leaves_its_sessions_entry_as_it_was(chunking_apps, monkeypatch):
    chat = Chat(chunking_apps, SYSTEM)
    first = chat.send("Tell me about the harbour.")
    runner, replies = chunking_apps[0].backend.engine.runner, []
    prefill, chunks = runner.prefill, []

    def cancelling_after_the_second(*args):
        chunks.append(args)
        if len(chunks) == 2:
            replies[0].cancel()
        return prefill(*args)

    monkeypatch.setattr(runner, "prefill", cancelling_after_the_second)
    replies.append(chat.cached.send(LONG, max_new_tokens=6))
    assert replies[0].result().stop_reason == "cancelled"
    monkeypatch.undo()

    entry = chunking_apps[0].backend.engine.cache.entry(chat.cached.id)
    assert len(chunks) == 2 and entry.length == written(first) and entry.pins == 0
    block, offset = divmod(entry.length, runner.kv.shape.block_tokens)
    if runner.kv.zeroed and offset:  # graphs read past a chat's end: the cut prefill's rows must not be there
        last = entry.table[block]
        assert not any(layer[last, :, offset:].any() for layer in runner.kv.keys + runner.kv.values)
    del chat.cached.history[-2:]  # the cancelled turn, asked again
    again = chat.send(LONG)
    assert again.tokens.computed == again.tokens.prompt - written(first)


def test_out_of_memory_between_two_chunks_fails_only_that_request(chunking, monkeypatch):
    app = chunking[0]
    runner, chunks = app.backend.engine.runner, []
    prefill = runner.prefill

    def out_of_memory_at_the_second_chunk(*args):
        chunks.append(args)
        if len(chunks) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return prefill(*args)

    monkeypatch.setattr(runner, "prefill", out_of_memory_at_the_second_chunk)
    with pytest.raises(RequestError, match="out of memory"):
        app.session().send(LONG).result()
    monkeypatch.undo()
    assert len(chunks) == 2
    assert app.session().send(LONG, max_new_tokens=4).result().tokens.generated == 4
    assert held_by_entries_only(app)  # the failed request let go of its blocks


def held_by_entries_only(app) -> bool:
    """Every block held is held by a cache entry: no request still holds any."""
    cache = app.backend.engine.cache
    kept = {block for entry in cache.entries.values() if entry.table for block in entry.table}
    return cache.pool.held == len(kept) and all(entry.pins == 0 for entry in cache.entries.values())


def several_first_questions(app: OmniLocal, texts: list[str]) -> list:
    """The prefill and decode calls while `texts` are sent at once by new sessions: the first
    question's prefill waits until every one is sent, so the others are all waiting at its next turn."""
    entered, sent, replies = threading.Event(), threading.Event(), []
    runner = app.backend.engine.runner

    with forwards_of(app, decodes=True) as calls:
        recording = runner.prefill

        def first_waits(table, prepared):
            entered.set()
            sent.wait(timeout=30)
            return recording(table, prepared)

        with patch.object(runner, "prefill", first_waits):
            replies.append(app.session().send(texts[0], max_new_tokens=4))
            assert entered.wait(timeout=30)
        replies += [app.session().send(text, max_new_tokens=4) for text in texts[1:]]
        sent.set()
        finals = [reply.result() for reply in replies]
    assert all(final.tokens.generated == 4 for final in finals)
    return calls


def test_short_first_questions_sent_at_once_beside_a_decoding_reply_share_one_forward_before_its_next_step(
        demo_settings, demo_checkpoint):
    off = demo_settings.replace(prefix_cache=False, encoder_cache=False, prefill_chunk_tokens=64)
    with OmniLocal(off) as app:
        calls = several_first_questions(app, ["Hi?", "Hello?", "Hey?", "Yo?"])
        packs = app.backend.engine.runner.packs_prefills
    # The first question alone, then the other three in the next turn (about 30 tokens, within 64), in
    # one forward where the runner packs prefills (else each its own), and only then the first reply's
    # next decode step.
    first, *beside = calls[: calls.index("decode")]
    assert isinstance(first, tuple)
    assert [len(call) for call in beside] == [3] if packs else len(beside) == 3


def test_the_prefills_of_a_turn_stay_within_one_chunk_of_tokens(chunking):
    app = chunking[1]  # chunks of 16 tokens: one short question's prefill fills a turn's budget
    calls = several_first_questions(app, ["Hi?", "Hello?", "Hey?"])
    prefills = [i for i, call in enumerate(calls) if call != "decode"]
    # One question a turn (each about 10 tokens), the first reply's decode steps between them.
    assert len(prefills) == 3 and all("decode" in calls[a + 1 : b] for a, b in zip(prefills[1:], prefills[2:]))
