"""A request whose logits are not numbers (NaN or infinity) fails alone with a clear message, its KV
is scrubbed, and no other chat, nor its own next turn, ever reads a row of it: each gives exactly
the tokens of an app that never saw it. Rows a chat does not own never reach its attention, even
where a CUDA graph reads a whole bucket of rows past the chat's end.

The tests marked `cuda` run with OMNI_LOCAL_TEST_DEVICE=cuda, with CUDA graphs on; the others run on
any device.
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import numpy as np
import pytest
import torch

from samples import clip
from kv_budget import kv_rows
from omni_local.api import OmniLocal
from omni_local.engine.endings import NOT_A_NUMBER
from omni_local.engine.forward.cuda_graphs import attention_buckets
from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.engine.memory.kv_store import GraphedKVWriter, KVStore
from omni_local.engine.memory.prefix_cache import PrefixCache
from omni_local.engine.prompt.builder import build_prompt
from omni_local.errors import RequestError
from omni_local.protocol.messages import Message

REPLY_TOKENS = 12
HEARD = "What do you hear?"
# Each test's own questions and sound: a prompt an earlier test left in the cache would be reused,
# not computed (and a poisoned one would not reach the encoder).
EAGER_CHATS = ["Tell me about lighthouses.", "What do fishermen sing?", "Describe the harbour at night.",
               "Name a bird of the sea."]
GRAPHED_CHATS = ["Why is the sea salty?", "How deep is the harbour?", "Who keeps the lighthouse?",
                 "When does the tide turn?"]
MORE_CHATS = ["What do gulls eat?", "Where do the boats go in winter?", "How old is the pier?"]
BESIDE = ["Tell me a story about a whale.", "Tell me a story about a crab.", "And about an octopus?"]


@pytest.fixture(scope="module")
def twins(demo_settings, tmp_path_factory):
    """Two apps of KV for a few chats each (8 blocks of 16 tokens), so blocks change hands between
    sessions: the first to be poisoned, the second clean. Each keeps its encoder outputs in its own
    folder."""
    few_chats = kv_rows(demo_settings, 128)
    folders = [tmp_path_factory.mktemp(name) for name in ("poisoned", "clean")]
    with OmniLocal(few_chats.replace(cache_dir=str(folders[0]))) as poisoned, \
            OmniLocal(few_chats.replace(cache_dir=str(folders[1]))) as clean:
        yield poisoned, clean


@pytest.fixture
def full_replies(twins, monkeypatch):
    """Every reply runs to its last token: the demo model's can end at once, and an empty reply
    would agree with any other."""
    for app in twins:
        monkeypatch.setattr(app.backend.engine, "eos_ids", set())


def audio_encoder_gives_nan(app: OmniLocal):
    """Meanwhile, the audio encoder's outputs are NaN: a fault uploads can no longer cause."""
    encoders = app.backend.engine.runner.encoder.encoders
    real = encoders.audio
    return patch.object(encoders, "audio", lambda *inputs: real(*inputs) * float("nan"))


@contextmanager
def blocks_taken(kv: KVStore) -> Iterator[list[list[int]]]:
    """The blocks `kv` hands out meanwhile, each request's in a list, in order."""
    handed, real = [], kv.take

    def take(count: int) -> list[int] | None:
        blocks = real(count)
        if blocks:
            handed.append(blocks)
        return blocks

    with patch.object(kv, "take", take):
        yield handed


def reaching(blocks: list[int], handed: list[list[int]]) -> int:
    """How many of the requests that were handed `handed` got one of `blocks`."""
    return sum(bool(set(blocks) & set(later)) for later in handed)


def reply(app: OmniLocal, session, text: str, **media) -> list[int]:
    return session.send(text, max_new_tokens=REPLY_TOKENS, **media).result().token_ids


def clean_chats(app: OmniLocal, first_session, texts: list[str], sound: np.ndarray) -> list[list[int]]:
    """The replies after the poisoned turn: its chat's next turn (`texts[0]`), a new session for
    each other text (with blocks for a few chats, each takes blocks a chat before it held), then the poisoned turn's
    `sound` asked about again in a new session."""
    replies = [reply(app, first_session, texts[0])]
    replies += [reply(app, app.session(), text) for text in texts[1:]]
    return [*replies, reply(app, app.session(), HEARD, audio=[sound])]


def poison_then_chat(poisoned: OmniLocal, texts: list[str], sound: np.ndarray
                     ) -> tuple[str, int, list[int], list[list[int]]]:
    """The error of a turn asking about `sound` while the audio encoder gives NaN, the blocks it was
    handed (checked zeroed once it failed), then the blocks handed out and the replies of `clean_chats`."""
    kv, session = poisoned.backend.engine.runner.kv, poisoned.session()
    with blocks_taken(kv) as handed, audio_encoder_gives_nan(poisoned), pytest.raises(RequestError) as error:
        reply(poisoned, session, HEARD, audio=[sound])
    blocks = handed[0]
    assert all(not layer[blocks].any() for layer in kv.keys + kv.values), "the poisoned rows must be zeroed"
    with blocks_taken(kv) as handed:
        replies = clean_chats(poisoned, session, texts, sound)
    return str(error.value), blocks, handed, replies


def test_a_chat_whose_logits_are_not_numbers_fails_alone_and_every_chat_after_it_gets_a_clean_apps_replies(
    twins, full_replies
):
    poisoned, clean = twins

    message, blocks, handed, replies = poison_then_chat(poisoned, EAGER_CHATS, clip(11))

    assert message == NOT_A_NUMBER
    assert reaching(blocks, handed), "the poisoned chat's blocks must go to a chat after it"
    assert replies == clean_chats(clean, clean.session(), EAGER_CHATS, clip(11))
    assert all(len(tokens) == REPLY_TOKENS for tokens in replies)


def test_a_request_whose_logits_turn_to_nan_while_decoding_beside_another_fails_alone(twins, full_replies):
    poisoned, clean = twins
    kv, runner = poisoned.backend.engine.runner.kv, poisoned.backend.engine.runner
    real, batches = runner.decode, []

    def decode_turning_the_second_chat_nan(tables, *args):
        """The decode steps' logits; the second chat's are NaN from the engine's fourth step on (the
        chat's third), while the first chat, a turn ahead, still decodes beside it."""
        logits = real(tables, *args)
        batches.append(len(tables))
        second = next((i for i, table in enumerate(tables) if len(handed) == 2 and handed[1][0] in table), None)
        if second is not None and len(batches) >= 4:
            with torch.inference_mode():
                logits[second] = float("nan")
        return logits

    steady, failing = poisoned.session(), poisoned.session()
    with blocks_taken(kv) as handed, patch.object(runner, "decode", decode_turning_the_second_chat_nan):
        replies = [steady.send(BESIDE[0], max_new_tokens=REPLY_TOKENS),
                   failing.send(BESIDE[1], max_new_tokens=REPLY_TOKENS)]
        with pytest.raises(RequestError, match=re.escape(NOT_A_NUMBER)):
            replies[1].result()
        steady_tokens = replies[0].result().token_ids

    assert max(batches) == 2, "the chats must decode together"
    assert steady_tokens == reply(clean, clean.session(), BESIDE[0])
    assert not any(layer[handed[1]].any() for layer in kv.keys + kv.values), "the failed chat's rows must be zeroed"
    assert reply(poisoned, failing, BESIDE[2]) == reply(clean, clean.session(), BESIDE[2])


def test_scrubbed_blocks_are_zeroed_and_their_sessions_entry_dropped_even_where_rows_start_uninitialised(twins):
    app = twins[0]
    shape = app.backend.engine.runner.kv.shape
    store = KVStore(shape, shape.table_blocks + 1, dtype=torch.float32, device=torch.device("cpu"))
    cache = PrefixCache(store, host_budget_bytes=0, enabled=True)
    prompt = build_prompt([Message("user", ["Hello."])], app.backend.loaded.processor)
    claim = cache.claim("chat", prompt, cache.match(prompt), shape.max_tokens)
    for layer in store.keys + store.values:
        layer.fill_(float("nan"))  # its blocks' rows, and the pad block's its padding wrote

    cache.discard(claim)

    assert cache.entry("chat") is None and store.pool.free == store.pool.usable
    assert all(not layer.any() for layer in store.keys + store.values)


@torch.inference_mode()
def bucket_decode(runner: ThinkerRunner, store: KVStore, table: list[int], text: str) -> torch.Tensor:
    """Logits of the first decode step after a one-turn prompt of `text`, prefilled eagerly into the
    blocks of `table`: the step a decode graph captures, attending over a whole bucket of rows."""
    prompt = build_prompt([Message("user", [text])], runner.encoder.processor)
    prepared = runner.prepare(prompt, 0, remember=False)
    first = runner._prefill_step(store.writer(table, 0), prepared.embeds, prepared.positions).argmax(-1)
    index, device, size = prompt.num_tokens, runner.device, store.shape.block_tokens
    tables = torch.tensor([table], device=device)
    where = torch.tensor([[index, table[index // size], index % size, 0]], device=device)
    rows = attention_buckets(store.shape.max_tokens)[0]
    cache = GraphedKVWriter(store, tables, where[:, :1], where[:, 1:2], where[:, 2:3], where[0, 3:], rows)
    positions = torch.full((3, 1, 1), index + prepared.rope_delta, device=device)
    return runner._decode_step(cache, first[:, None], positions)


def test_blocks_given_back_by_a_chat_whose_rows_are_not_numbers_read_as_fresh_ones_over_a_graphs_bucket(twins):
    runner = twins[0].backend.engine.runner
    shape, dtype, device = runner.kv.shape, runner.dtype, runner.device
    handed_over, fresh = (KVStore(shape, shape.table_blocks + 1, dtype, device, zeroed=True) for _ in range(2))
    blocks = handed_over.take(shape.table_blocks)
    for layer in handed_over.keys + handed_over.values:
        layer[blocks].fill_(float("nan"))  # every row, past the next chat's end too
    handed_over.pool.release(blocks)

    logits = bucket_decode(runner, handed_over, handed_over.take(shape.table_blocks), EAGER_CHATS[0])

    assert torch.isfinite(logits).all()
    assert torch.equal(logits, bucket_decode(runner, fresh, fresh.take(shape.table_blocks), EAGER_CHATS[0]))


@pytest.fixture
def graphed_twins(twins):
    poisoned, clean = twins
    if poisoned.backend.engine.runner.device.type != "cuda":
        pytest.skip("the demo model runs on the CPU: set OMNI_LOCAL_TEST_DEVICE=cuda")
    assert all(app.backend.engine.runner.decode_graphs is not None for app in twins), "CUDA graphs must be on"
    return poisoned, clean


@pytest.mark.cuda
def test_with_cuda_graphs_a_poisoned_chat_leaves_every_chat_in_its_blocks_after_it_equal_to_a_clean_apps(
    graphed_twins, full_replies
):
    poisoned, clean = graphed_twins

    runner = poisoned.backend.engine.runner
    with patch.object(runner.decode_graphs, "replay", wraps=runner.decode_graphs.replay) as decodes, \
            patch.object(runner.prefill_graphs, "replay", wraps=runner.prefill_graphs.replay) as prefills:
        message, blocks, handed, replies = poison_then_chat(poisoned, GRAPHED_CHATS, clip(12))

    assert message == NOT_A_NUMBER
    assert decodes.call_count and prefills.call_count, "the chats must run through the graphs"
    assert reaching(blocks, handed) >= 2, "the poisoned chat's blocks must go to new sessions after it"
    assert replies == clean_chats(clean, clean.session(), GRAPHED_CHATS, clip(12))


@pytest.mark.cuda
def test_with_cuda_graphs_rows_past_a_chats_end_that_are_not_numbers_never_reach_the_next_chat_in_its_blocks(
    graphed_twins, full_replies
):
    poisoned, clean = graphed_twins
    kv, session = poisoned.backend.engine.runner.kv, poisoned.session()
    first = reply(poisoned, session, "Say something about the tide.")
    entry = poisoned.backend.engine.cache.entry(session.id)
    # What a chat leaves past its end in its last block (garbage, here NaN), read masked by a graph's bucket.
    last, offset = entry.table[-1], entry.length % kv.shape.block_tokens
    assert offset, "the chat must end inside a block"
    for layer in kv.keys + kv.values:
        layer[last, :, offset:].fill_(float("nan"))

    with blocks_taken(kv) as handed:
        replies = [reply(poisoned, poisoned.session(), text) for text in MORE_CHATS]

    assert reaching([last], handed), "the chat's last block must go to a new session"
    assert first == reply(clean, clean.session(), "Say something about the tide.")
    assert replies == [reply(clean, clean.session(), text) for text in MORE_CHATS]
