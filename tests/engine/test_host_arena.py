"""The host tier's arena: rows go to its slots and come back bit for bit, in runs of slots however the
device blocks lie; its copies are queued, so the blocks a move reads stay held until it has run and
a chat whose rows come back is not computed before they are there. (On the CPU a copy is done when
queued: a copy still running is played here by a transfer that says so until told otherwise.)"""

import itertools
import threading
import time
from unittest.mock import patch

import pytest
import torch

from cache_requests import prompt, run
from omni_local.api import OmniLocal, TextDelta
from omni_local.engine.memory.host_arena import HostArena, Transfer
from omni_local.engine.memory.kv_store import KVShape, KVStore
from omni_local.engine.memory.prefix_cache import PrefixCache
from waiting import until

SHAPE = KVShape(num_layers=2, kv_heads=1, head_dim=2, max_tokens=32, talker_dim=3, block_tokens=4)


class Running:
    """A copy's event that has not passed until `finish`."""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True


@pytest.fixture
def running(monkeypatch) -> list[Running]:
    """Every copy the arenas queue meanwhile, done at once but reported running until finished."""
    events = []

    def queue(arena, copies):
        copies()
        events.append(Running())
        return Transfer(events[-1])

    monkeypatch.setattr(HostArena, "_queue", queue)
    return events


def numbered(kv: KVStore) -> None:
    """Every value of every block tensor distinct."""
    counter = itertools.count()
    for tensor in kv.block_tensors():
        tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype).view(tensor.shape) + 1000 * next(counter))


def test_rows_saved_from_scattered_blocks_come_back_bit_for_bit_into_others_talker_rows_with_them():
    kv = KVStore(SHAPE, 17, torch.float32, torch.device("cpu"))
    numbered(kv)
    arena = HostArena(kv, blocks=6)
    first = arena.save([9, 3], rows=8)  # slots 0, 1
    source = [5, 2, 11]
    host = arena.save(source, rows=10)  # slots 2, 3, 4
    arena.release(first)
    assert host.slots == [2, 3, 4] and arena.free == 3
    expected = [tensor[source].clone() for tensor in kv.block_tensors()]

    target = [7, 1, 14]
    arena.load(host, target, rows=10).wait()

    for tensor, rows in zip(kv.block_tensors(), expected):
        assert torch.equal(tensor[target], rows)
    split = [4, 6, 8]
    expected = [tensor[split].clone() for tensor in kv.block_tensors()]
    again = arena.save(split, rows=12)
    assert again.slots == [0, 1, 5], "two runs of slots"
    arena.load(again, [12, 13, 15], rows=12).wait()
    for tensor, rows in zip(kv.block_tensors(), expected):
        assert torch.equal(tensor[[12, 13, 15]], rows)


def test_the_blocks_a_move_to_host_reads_stay_held_until_it_has_run(running):
    kv = KVStore(SHAPE, SHAPE.table_blocks + 1, torch.float32, torch.device("cpu"))
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5]))  # 2 blocks
    cache._move_to_host(cache.entry("a"), keep=None)
    assert cache.entry("a").host is not None and kv.pool.held == 2

    cache.settle()
    assert kv.pool.held == 2, "its copy has not run"
    running[-1].passed = True
    cache.settle()
    assert kv.pool.held == 0


def test_a_request_that_needs_the_blocks_of_a_move_still_running_waits_for_that_move_only(running):
    kv = KVStore(SHAPE, SHAPE.table_blocks + 1, torch.float32, torch.device("cpu"))
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5]), rows=SHAPE.max_tokens)
    other = prompt([7, 8, 9])

    claim = cache.claim("b", other, cache.match(other), SHAPE.max_tokens)  # every block: "a" must move

    assert claim is not None and running[-1].passed, "the host waited for the move whose blocks it took"
    assert cache.entry("a").host is not None


def test_a_chat_whose_rows_come_back_from_host_is_ready_once_they_are_there(running):
    kv = KVStore(SHAPE, SHAPE.table_blocks + 1, torch.float32, torch.device("cpu"))
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5]))
    cache._move_to_host(cache.entry("a"), keep=None)
    running[-1].passed = True
    again = prompt([1, 2, 3, 4, 5, 6])

    claim = cache.claim("a", again, cache.match(again), 8)

    assert claim.reused_host == 5 and not claim.ready
    running[-1].passed = True
    assert claim.ready


def test_a_chat_whose_rows_come_back_from_host_waits_for_them_alone_and_answers_as_without_the_cache(
    demo_settings, demo_checkpoint, running
):
    settings = demo_settings.replace(encoder_cache=False)
    with OmniLocal(settings) as probe:
        block_bytes = probe.backend.engine.runner.kv.shape.block_bytes(probe.backend.engine.runner.dtype)
    # Blocks for one chat of max_context_tokens: fewer than the engine keeps free while idle, so
    # each chat's rows move to host memory as soon as nobody runs.
    small = settings.replace(gpu_cache_bytes=65 * block_bytes)
    with OmniLocal(small) as app, OmniLocal(small.replace(prefix_cache=False)) as off:
        engine = app.backend.engine
        chat, expected = app.session(), off.session()
        for session in (chat, expected):
            session.send("Hello.", max_new_tokens=8, temperature=0.0).result()
        until(lambda: engine.cache.entry(chat.id).host is not None, "the idle chat's rows must move to host memory")

        prefills, prefill = [], engine.runner.prefill
        with patch.object(engine.runner, "prefill", lambda *args: prefills.append(time.monotonic()) or prefill(*args)):
            other = app.session().send("What do fishermen sing at night?", max_new_tokens=400, temperature=0.0)
            streamed = []
            reader = threading.Thread(target=lambda: [streamed.append(e) for e in other if isinstance(e, TextDelta)])
            reader.start()
            # Its prompt begins as the chat's does: its rows come from host memory too, at once here.
            until(lambda: [setattr(event, "passed", True) for event in running] and streamed,
                  "the other chat must stream")
            second = chat.send("And then?", max_new_tokens=8, temperature=0.0)
            sent, before = time.monotonic(), len(streamed)
            until(lambda: len(streamed) >= before + 20, "the other chat must go on streaming meanwhile")
            assert not [t for t in prefills if t > sent], "its prefill must wait for its rows"
            released = time.monotonic()
            for event in running:
                event.passed = True
            final = second.result()
            reader.join()
        assert final.tokens.reused_host > 0 and [t for t in prefills if t > released]
        assert final.token_ids == expected.send("And then?", max_new_tokens=8, temperature=0.0).result().token_ids
