"""A prompt is computed in chunks at fixed positions, one per engine turn: chunked, it gives the
tokens of one whole prefill and of transformers' own; a medium across a boundary is encoded once;
other chats decode between the chunks; a prefill cut short leaves its session's entry as it was.

(conftest's settings chunk every test's prefills; here the chunk is smaller still, and the whole
prefill is one chunk of the context's length.)
"""

from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch

from chats import Chat, written
from replies import media, reference_tokens
from samples import clip, picture
from omni_local.api import OmniLocal, TextDelta
from omni_local.api.messages import Message
from omni_local.engine.prefill_chunks import chunk_bounds
from omni_local.prompts import build_prompt

CHUNK = 16
SYSTEM = "You are a helpful assistant."
LONG = " ".join(f"Rule {i}: answer the sailor plainly." for i in range(12))  # about 200 tokens
CASES = {
    "text": lambda: [LONG],
    "image": lambda: [picture(1), "What is in this picture?"],  # its 20 tokens hold the boundary at 32
    "224x224 image and audio": lambda: [picture(3, (224, 224)), clip(4, 3.0), "Describe both."],
}


@pytest.fixture(scope="module")
def chunked_and_whole(demo_settings, demo_checkpoint) -> Iterator[tuple[OmniLocal, OmniLocal]]:
    """The demo twice, every cache off: prefills in chunks of CHUNK tokens, and in one chunk."""
    off = demo_settings.replace(prefix_cache=False, encoder_cache=False)
    whole = off.replace(prefill_chunk_tokens=off.max_context_tokens)
    with OmniLocal(off.replace(prefill_chunk_tokens=CHUNK)) as chunked, OmniLocal(whole) as one:
        yield chunked, one


@contextmanager
def chunks_of(app: OmniLocal) -> Iterator[list[tuple[int, int]]]:
    """The (begin, end) rows of every prefill chunk the app computes meanwhile, in order."""
    runner, calls = app.backend.engine.runner, []
    real = runner.prefill_chunk

    def recording(slot, prepared, begin):
        end, logits = real(slot, prepared, begin)
        calls.append((begin, end))
        return end, logits

    with patch.object(runner, "prefill_chunk", recording):
        yield calls


@pytest.mark.parametrize("case", CASES)
def test_a_prompt_of_several_chunks_gives_the_tokens_of_one_whole_prefill_and_of_transformers(
    chunked_and_whole, case
):
    parts = CASES[case]()
    finals, chunks = [], []
    for app in chunked_and_whole:
        with chunks_of(app) as calls:
            finals.append(app.session(SYSTEM).send(parts[-1], **media(parts), max_new_tokens=12).result())
        chunks.append(calls)
    prompt = finals[0].tokens.prompt
    assert chunks == [chunk_bounds(0, prompt, CHUNK), [(0, prompt)]] and len(chunks[0]) > 2
    assert finals[0].token_ids == finals[1].token_ids
    assert finals[0].token_ids, "the reply must not be empty, or the comparison proves little"
    assert finals[0].token_ids == reference_tokens(chunked_and_whole[0], [Message("system", [SYSTEM]),
                                                                          Message("user", parts)])[:12]


def test_an_image_across_chunk_boundaries_is_encoded_once_and_its_deepstack_rows_are_split_between_them(
    chunked_and_whole,
):
    app = chunked_and_whole[0]
    parts = [picture(3, (224, 224)), "What is in this picture?"]
    prompt = build_prompt([Message("user", parts)], app.backend.loaded.processor)
    image = prompt.media[0]
    assert image.start // CHUNK < (image.end - 1) // CHUNK - 1, "the image must span more than two chunks"
    runner = app.backend.engine.runner
    prepared = runner.prepare(prompt, 0, remember=False)
    parts_of = [prepared.rows(begin, end) for begin, end in chunk_bounds(0, prompt.num_tokens, CHUNK)]
    for level, whole in enumerate(prepared.deepstack):
        split = torch.cat([p.deepstack[level] for p in parts_of if p.deepstack is not None])
        assert torch.equal(split, whole)
    masks = [p.visual_mask if p.visual_mask is not None else torch.zeros_like(p.ids, dtype=torch.bool)
             for p in parts_of]
    assert torch.equal(torch.cat(masks, dim=1), prepared.visual_mask)

    encoders = runner.encoder.encoders
    with patch.object(encoders, "images", wraps=encoders.images) as encoded:
        final = app.session().send(parts[1], images=[parts[0]], max_new_tokens=12).result()
    assert encoded.call_count == 1 and final.media.encoded == 1
    assert final.token_ids, "the reply must not be empty, or the comparison proves little"
    assert final.token_ids == reference_tokens(app, [Message("user", parts)])[:12]


def test_a_tail_on_a_cached_prefix_runs_to_the_next_multiple_of_the_chunk_then_in_whole_chunks(apps):
    chunk = apps[0].settings.prefill_chunk_tokens
    chat = Chat(apps, SYSTEM)
    first = chat.send("Tell me about the lighthouse keeper.")
    with chunks_of(apps[0]) as calls:
        second = chat.send(LONG)
    start, end = written(first), second.tokens.prompt
    assert second.tokens.reused_gpu == start and start % chunk
    assert calls == chunk_bounds(start, end, chunk)
    assert calls[0][1] == (start // chunk + 1) * chunk and all(b % chunk == 0 for b, _ in calls[1:])


def test_a_chat_decoding_gets_a_token_between_every_two_chunks_of_a_long_prompt(chunked_and_whole, monkeypatch):
    app = chunked_and_whole[0]
    engine = app.backend.engine
    monkeypatch.setattr(engine, "eos_ids", set())  # the decoding chat runs to its last token
    order, decode, prefill_chunk = [], engine.runner.decode, engine.runner.prefill_chunk
    monkeypatch.setattr(engine.runner, "decode", lambda *args: order.append("decode") or decode(*args))
    # A chunk is named by the length of its prompt.
    monkeypatch.setattr(engine.runner, "prefill_chunk",
                        lambda slot, prepared, begin: order.append(prepared.end) or prefill_chunk(slot, prepared, begin))
    steady = app.session().send("Tell me about the tide.", max_new_tokens=60)
    next(event for event in steady if isinstance(event, TextDelta))  # it decodes now
    long = app.session().send(LONG, max_new_tokens=4).result()
    steady_tokens = steady.result().token_ids

    prompt = long.tokens.prompt
    chunks = len(chunk_bounds(0, prompt, CHUNK))
    first, last = order.index(prompt), len(order) - 1 - order[::-1].index(prompt)
    assert order[first : last + 1] == [prompt, "decode"] * (chunks - 1) + [prompt]
    assert steady_tokens == app.session().send("Tell me about the tide.", max_new_tokens=60).result().token_ids


def test_a_prefill_cancelled_between_its_chunks_leaves_its_sessions_entry_as_it_was(apps, monkeypatch):
    chat = Chat(apps, SYSTEM)
    first = chat.send("Tell me about the harbour.")
    runner, replies = apps[0].backend.engine.runner, []
    prefill_chunk, chunks = runner.prefill_chunk, []

    def cancelling_after_the_second(*args):
        chunks.append(args)
        if len(chunks) == 2:
            replies[0].cancel()
        return prefill_chunk(*args)

    monkeypatch.setattr(runner, "prefill_chunk", cancelling_after_the_second)
    replies.append(chat.cached.send(LONG, max_new_tokens=6))
    assert replies[0].result().stop_reason == "cancelled"
    monkeypatch.undo()

    entry = apps[0].backend.engine.cache.entries[chat.cached.id]
    assert len(chunks) == 2 and entry.length == written(first) and entry.pins == 0
    if runner.kv.zeroed:  # graphs read past a chat's end: the cut prefill's rows must not be there
        assert not any(layer[entry.slot, :, entry.length :].any() for layer in runner.kv.keys + runner.kv.values)
    del chat.cached.history[-2:]  # the cancelled turn, asked again
    again = chat.send(LONG)
    assert again.tokens.computed == again.tokens.prompt - written(first)
