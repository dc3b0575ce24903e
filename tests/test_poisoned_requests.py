"""Rows a chat does not own never reach its attention, even where a CUDA graph reads a whole
bucket of rows past the chat's end: each chat gives exactly the tokens of an app that never held
bad rows.

The tests marked `cuda` run with OMNI_LOCAL_TEST_DEVICE=cuda, with CUDA graphs on; the others run on
any device.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.engine.cuda_graphs import SMALLEST_BUCKET
from omni_local.engine.kv_store import GraphedSlotWriter, KVStore
from omni_local.engine.thinker import ThinkerRunner
from omni_local.prompts import Message, build_prompt

TOKEN_BYTES = 2 << 10  # the demo's KV per token (conftest)
REPLY_TOKENS = 12
# Each test's own questions: a prompt an earlier test left in the cache would be reused, not computed.
EAGER_CHATS = ["Tell me about lighthouses.", "What do fishermen sing?", "Describe the harbour at night.",
               "Name a bird of the sea."]
MORE_CHATS = ["What do gulls eat?", "Where do the boats go in winter?", "How old is the pier?"]


@pytest.fixture(scope="module")
def twins(demo_settings, tmp_path_factory):
    """Two apps of two KV slots each, so slots change hands between sessions: the first to be
    poisoned, the second clean. Each keeps its encoder outputs in its own folder."""
    two_slots = demo_settings.replace(gpu_cache_bytes=2 * demo_settings.max_context_tokens * TOKEN_BYTES)
    folders = [tmp_path_factory.mktemp(name) for name in ("poisoned", "clean")]
    with OmniLocal(two_slots.replace(cache_dir=str(folders[0]))) as poisoned, \
            OmniLocal(two_slots.replace(cache_dir=str(folders[1]))) as clean:
        yield poisoned, clean


@pytest.fixture
def full_replies(twins, monkeypatch):
    """Every reply runs to its last token: the demo model's can end at once, and an empty reply
    would agree with any other."""
    for app in twins:
        monkeypatch.setattr(app.engine, "eos_ids", set())


@contextmanager
def slots_allocated(kv: KVStore) -> Iterator[list[int]]:
    """The slots `kv` hands out meanwhile, in order."""
    handed, real = [], kv.allocate

    def allocate() -> int | None:
        slot = real()
        if slot is not None:  # None: every slot is held, and the cache moves an entry to host memory
            handed.append(slot)
        return slot

    with patch.object(kv, "allocate", allocate):
        yield handed


def reply(app: OmniLocal, session, text: str, **media) -> list[int]:
    return session.send(text, max_new_tokens=REPLY_TOKENS, **media).result().token_ids


@torch.inference_mode()
def bucket_decode(runner: ThinkerRunner, store: KVStore, slot: int, text: str) -> torch.Tensor:
    """Logits of the first decode step after a one-turn prompt of `text`, prefilled eagerly into
    `slot`: the step a decode graph captures, attending over a whole bucket of the slot's rows."""
    prompt = build_prompt([Message("user", [text])], runner.encoder.processor)
    prepared = runner.prepare(prompt, 0, remember=False)
    first = runner._prefill_step(store.view(slot, 0), prepared.embeds, prepared.positions).argmax(-1)
    index, device = prompt.num_tokens, runner.device
    on_device = torch.tensor([slot, index, 0], device=device)
    cache = GraphedSlotWriter(store, on_device[:1], on_device[1:2].view(1, 1), on_device[2:], rows=SMALLEST_BUCKET)
    positions = torch.full((3, 1, 1), index + prepared.rope_delta, device=device)
    return runner._decode_step(cache, first[:, None], positions)


def test_a_slot_given_back_by_a_chat_whose_rows_are_not_numbers_reads_as_a_fresh_one_over_a_graphs_bucket(twins):
    runner = twins[0].engine.runner
    shape, dtype, device = runner.kv.shape, runner.dtype, runner.device
    handed_over, fresh = (KVStore(shape, 1, dtype, device, zeroed=True) for _ in range(2))
    slot = handed_over.allocate()
    for layer in handed_over.keys + handed_over.values:
        layer[slot].fill_(float("nan"))  # every row, past the next chat's end too
    handed_over.release(slot)

    logits = bucket_decode(runner, handed_over, handed_over.allocate(), EAGER_CHATS[0])

    assert torch.isfinite(logits).all()
    assert torch.equal(logits, bucket_decode(runner, fresh, fresh.allocate(), EAGER_CHATS[0]))


@pytest.fixture
def graphed_twins(twins):
    poisoned, clean = twins
    if poisoned.engine.runner.device.type != "cuda":
        pytest.skip("the demo model runs on the CPU: set OMNI_LOCAL_TEST_DEVICE=cuda")
    assert all(app.engine.runner.decode_graphs is not None for app in twins), "CUDA graphs must be on"
    return poisoned, clean


@pytest.mark.cuda
def test_with_cuda_graphs_rows_past_a_chats_end_that_are_not_numbers_never_reach_the_next_chat_in_its_slot(
    graphed_twins, full_replies
):
    poisoned, clean = graphed_twins
    kv, session = poisoned.engine.runner.kv, poisoned.session()
    first = reply(poisoned, session, "Say something about the tide.")
    entry = poisoned.engine.cache.entries[session.id]
    # What a chat leaves past its end in its slot (garbage, here NaN), read masked by a graph's bucket.
    for layer in kv.keys + kv.values:
        layer[entry.slot, :, entry.length :].fill_(float("nan"))
    slot = entry.slot

    with slots_allocated(kv) as handed:
        replies = [reply(poisoned, poisoned.session(), text) for text in MORE_CHATS]

    assert slot in handed, "the chat's slot must go to a new session"
    assert first == reply(clean, clean.session(), "Say something about the tide.")
    assert replies == [reply(clean, clean.session(), text) for text in MORE_CHATS]
