"""The prefix cache's rules, on a tiny KV store and hand-made prompts (no model)."""

import numpy as np
import torch

from omni_local.cache.digests import token_keys
from omni_local.engine.kv_store import KVShape, KVStore
from omni_local.engine.prefix_cache import PrefixCache
from omni_local.prompts import MediaItem, Prompt

SHAPE = KVShape(num_layers=2, kv_heads=1, head_dim=2, max_tokens=32)


def store(slots: int = 2) -> KVStore:
    return KVStore(SHAPE, slots, torch.float32, torch.device("cpu"))


def prompt(ids: list[int], media: list[tuple[int, int, bytes]] = ()) -> Prompt:
    items = [MediaItem(None, digest, start, length, grid=(1, 2, 2)) for start, length, digest in media]
    array = np.array(ids, dtype=np.int64)
    return Prompt(torch.tensor([ids]), items, token_keys(array, list(media)))


def run(cache: PrefixCache, session: str, p: Prompt, reply: list[int] = ()) -> int:
    """Claim, 'compute' and release like the engine; returns the tokens reused."""
    claim = cache.claim(session, p, cache.match(p))
    cache.publish(claim, p, list(reply), p.num_tokens + max(len(reply) - 1, 0))
    cache.release(claim)
    return claim.start


def test_the_last_prompt_token_is_always_computed():
    cache = PrefixCache(store(), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4]))
    assert cache.match(prompt([1, 2, 3, 4])).length == 3


def test_a_match_never_ends_inside_a_medium():
    cache = PrefixCache(store(), host_budget_bytes=0, enabled=True)
    same = prompt([1, 2, 9, 9, 9, 9, 5], [(2, 4, b"A" * 32)])
    run(cache, "a", same)
    entry = cache.entries["a"]
    entry.keys = entry.keys[:4]  # an entry that holds only half of the medium
    assert cache.match(same).length == 2


def test_a_medium_whose_short_keys_clash_is_still_told_apart_by_its_full_digest():
    cache = PrefixCache(store(), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 9, 9, 9, 9, 5, 6], [(2, 4, b"A" * 7 + b"x" * 25)]))
    clash = prompt([1, 2, 9, 9, 9, 9, 5, 6], [(2, 4, b"A" * 7 + b"y" * 25)])  # same first 7 bytes
    assert np.array_equal(clash.keys, cache.entries["a"].keys[:8])
    assert cache.match(clash).length == 2


def test_a_session_continues_in_its_own_slot_and_another_gets_a_copy():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5]))
    slot_a = cache.entries["a"].kv_slot
    assert run(cache, "a", prompt([1, 2, 3, 4, 5, 6, 7])) == 5
    assert cache.entries["a"].kv_slot == slot_a
    assert run(cache, "b", prompt([1, 2, 3, 8])) == 3
    assert cache.entries["b"].kv_slot != slot_a


def test_the_least_recently_used_idle_entry_moves_to_host_and_comes_back():
    kv = store(slots=2)
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3]))
    kv.keys[0][cache.entries["a"].kv_slot, :, :2] = torch.tensor([[[7.0, 7.0], [8.0, 8.0]]])
    run(cache, "b", prompt([4, 5, 6]))
    run(cache, "c", prompt([7, 8, 9]))
    assert cache.entries["a"].host is not None and cache.entries["a"].kv_slot is None
    claim = cache.claim("a", prompt([1, 2, 3, 10]), cache.match(prompt([1, 2, 3, 10])))
    assert claim.reused_host == 3
    assert torch.equal(kv.keys[0][claim.entry.kv_slot, :, :2], torch.tensor([[[7.0, 7.0], [8.0, 8.0]]]))


def test_an_entry_in_use_is_never_moved_and_a_request_waits_when_every_slot_is_in_use():
    cache = PrefixCache(store(slots=1), host_budget_bytes=1 << 20, enabled=True)
    first = prompt([1, 2, 3])
    held = cache.claim("a", first, cache.match(first))
    other = prompt([4, 5, 6])
    assert cache.claim("b", other, cache.match(other)) is None
    cache.release(held)
    assert cache.claim("b", other, cache.match(other)) is not None


def test_past_the_host_budget_the_oldest_entries_are_dropped():
    token_bytes = 2 * SHAPE.num_layers * SHAPE.kv_heads * SHAPE.head_dim * 4
    cache = PrefixCache(store(slots=1), host_budget_bytes=3 * token_bytes, enabled=True)
    for session, ids in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        run(cache, session, prompt(ids))
    assert cache.host_bytes <= 3 * token_bytes
    assert set(cache.entries) == {"b", "c"}  # "a" moved to host, then made room for "b"


def test_with_the_cache_off_nothing_is_kept_and_nothing_matches():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=False)
    run(cache, "a", prompt([1, 2, 3]))
    assert cache.entries == {} and kv.free_slots == kv.slots
    assert cache.match(prompt([1, 2, 3])).length == 0


def test_when_the_match_holds_the_only_slot_it_moves_to_host_and_is_read_back_from_there():
    kv = store(slots=1)
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4]))
    claim = cache.claim("b", prompt([1, 2, 3, 9]), cache.match(prompt([1, 2, 3, 9])))
    assert claim is not None and claim.reused_host == 3
    assert cache.entries["a"].host is not None


def test_when_the_match_holds_the_only_slot_and_host_memory_is_off_it_is_dropped_and_nothing_is_reused():
    cache = PrefixCache(store(slots=1), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4]))
    claim = cache.claim("b", prompt([1, 2, 3, 9]), cache.match(prompt([1, 2, 3, 9])))
    assert claim is not None and claim.start == 0
    assert "a" not in cache.entries


def test_talker_rows_travel_with_their_kv_between_slots_and_to_host_and_back():
    kv = KVStore(KVShape(num_layers=2, kv_heads=1, head_dim=2, max_tokens=8, talker_dim=3), 2, torch.float32,
                 torch.device("cpu"))
    for layer in kv.keys + kv.values:
        layer[0].copy_(torch.randn(layer[0].shape))
    kv.talker_rows[0].copy_(torch.randn(8, 3))
    kv.copy_rows(0, 1, rows=5)
    assert torch.equal(kv.talker_rows[1, :5], kv.talker_rows[0, :5])
    moved = [layer[0, :, :5].clone() for layer in kv.keys + kv.values], kv.talker_rows[0, :5].clone()
    host = kv.to_host(0, rows=5)
    assert host.nbytes == 5 * kv.shape.token_bytes(torch.float32)
    for tensor in [*kv.keys, *kv.values, kv.talker_rows]:
        tensor.zero_()  # the slots go to other chats, which overwrite them
    kv.from_host(host, 1, rows=5)
    assert torch.equal(kv.talker_rows[1, :5], moved[1])
    assert all(torch.equal(layer[1, :, :5], rows) for layer, rows in zip(kv.keys + kv.values, moved[0]))
