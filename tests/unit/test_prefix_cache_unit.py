"""The prefix cache's rules, on a tiny KV store of 4-token blocks and hand-made prompts (no model)."""

import numpy as np
import pytest
import torch

from cache_requests import prompt, run
from omni_local.access import LOCAL_USER, principal_salt
from omni_local.engine.memory.kv_blocks import chain
from omni_local.engine.memory.kv_store import KVShape, KVStore
from omni_local.engine.memory.prefix_cache import Match, PrefixCache
from omni_local.errors import RequestError

SHAPE = KVShape(num_layers=2, kv_heads=1, head_dim=2, max_tokens=32, block_tokens=4)
TABLE = SHAPE.table_blocks  # 8 blocks: the longest sequence


def store(sequences: int = 2, blocks: int | None = None, shape: KVShape = SHAPE) -> KVStore:
    """Blocks for `sequences` of the longest sequences (or `blocks` in all), and the pad block."""
    return KVStore(shape, blocks or sequences * shape.table_blocks + 1, torch.float32, torch.device("cpu"))


def fill(kv: KVStore, block: int, value: float) -> None:
    for layer in kv.keys + kv.values:
        layer[block].fill_(value)


def test_the_last_prompt_token_is_always_computed():
    cache = PrefixCache(store(), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5, 6, 7, 8]))
    assert cache.match(prompt([1, 2, 3, 4, 5, 6, 7, 8])).length == 7


def test_a_match_never_ends_inside_a_medium():
    cache = PrefixCache(store(), host_budget_bytes=0, enabled=True)
    same = prompt([1, 2, 9, 9, 9, 9, 5], [(2, 4, b"A" * 32)])
    run(cache, "a", same)
    entry = cache.entry("a")
    entry.keys = entry.keys[:4]  # an entry that holds only half of the medium
    assert cache.match(same).length == 2  # its first block, found by hash, ends inside the medium too


def test_a_medium_whose_short_keys_clash_is_still_told_apart_by_its_full_digest():
    cache = PrefixCache(store(), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 9, 9, 9, 9, 5, 6], [(2, 4, b"A" * 7 + b"x" * 25)]))
    clash = prompt([1, 2, 9, 9, 9, 9, 5, 6], [(2, 4, b"A" * 7 + b"y" * 25)])  # same first 7 bytes
    assert np.array_equal(clash.keys, cache.entry("a").keys[:8])
    assert cache.match(clash).length == 2


def test_a_session_continues_in_its_own_blocks():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5]))
    before = cache.entry("a").table
    assert run(cache, "a", prompt([1, 2, 3, 4, 5, 6, 7])) == 5
    assert cache.entry("a").table == before  # its partly filled second block continued in place


def test_sessions_that_begin_alike_hold_the_shared_blocks_once():
    kv = store(sequences=4)
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    system = list(range(100, 109))  # two full blocks and one token
    run(cache, "first", prompt(system + [1]))
    for session in range(16):
        assert run(cache, f"chat {session}", prompt(system + [200 + session, 2])) == 9
    shared = cache.entry("first").table[:2]
    assert all(cache.entry(f"chat {s}").table[:2] == shared for s in range(16))
    assert [kv.pool.holders(block) for block in shared] == [17, 17]
    assert kv.pool.held == 2 + 17  # the shared blocks once, and a last block for each chat


def test_another_chats_prefix_shorter_than_a_block_is_not_taken_but_a_chats_own_is():
    cache = PrefixCache(store(sequences=3), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 9, 9]))
    begins_alike = prompt([1, 2, 3, 7, 7, 7])  # 3 tokens in common: under a block of 4
    assert cache.match(begins_alike).length == 3
    assert cache.match(begins_alike, "b").length == 0
    assert cache.match(begins_alike, "a").length == 3
    assert cache.match(prompt([1, 2, 3, 9, 6]), "b").length == 4  # a whole block in common
    run(cache, "b", prompt([1, 2, 3, 8, 8]))  # begins as "a" does, for as long
    assert cache.match(begins_alike, "b") == Match(cache.entry("b"), 3)


def test_a_partly_shared_last_block_is_copied_before_it_is_written():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5, 6]))
    a_table = cache.entry("a").table
    fill(kv, a_table[1], 7.0)
    p = prompt([1, 2, 3, 4, 5, 6, 7, 8])
    claim = cache.claim("b", p, cache.match(p), p.num_tokens)
    b_table = claim.entry.table
    assert claim.start == 6 and claim.reused_gpu == 6
    assert b_table[0] == a_table[0] and b_table[1] != a_table[1]
    assert kv.pool.holders(a_table[1]) == 1  # a's own again once copied
    assert all(torch.equal(layer[b_table[1], :, :2], layer[a_table[1], :, :2]) for layer in kv.keys + kv.values)


def test_a_block_of_another_session_is_copied_even_when_the_prompt_ends_at_its_end():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5, 6]))
    a_table = cache.entry("a").table
    # A session's own block already shared with another must be copied as well: "b" shares a's first
    # block, and its second one of its own.
    assert run(cache, "b", prompt([1, 2, 3, 4, 5, 6, 9])) == 6
    assert cache.entry("b").table[0] == a_table[0] and cache.entry("b").table[1] != a_table[1]


def test_blocks_of_a_dropped_entry_are_found_by_hash_while_nobody_has_been_handed_them():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True, headroom_blocks=kv.pool.usable)
    run(cache, "a", prompt([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    cache.make_room()  # with no host memory, "a" is dropped to free every block
    assert cache.entry("a") is None and kv.pool.free == kv.pool.usable
    p = prompt([1, 2, 3, 4, 5, 6, 7, 8, 10])
    claim = cache.claim("b", p, cache.match(p), p.num_tokens)
    assert claim.start == 8 and claim.reused_gpu == 8


def test_the_least_recently_used_idle_entry_moves_to_host_and_comes_back():
    kv = store(sequences=1)
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3]))
    kv.keys[0][cache.entry("a").table[0], :, :2] = torch.tensor([[[7.0, 7.0], [8.0, 8.0]]])
    run(cache, "b", prompt([4, 5, 6]), rows=SHAPE.max_tokens)  # every block, once "a" is moved out
    assert cache.entry("a").host is not None and cache.entry("a").table is None
    claim = cache.claim("a", prompt([1, 2, 3, 10]), cache.match(prompt([1, 2, 3, 10])), 4)
    assert claim.reused_host == 3
    assert torch.equal(kv.keys[0][claim.entry.table[0], :, :2], torch.tensor([[[7.0, 7.0], [8.0, 8.0]]]))


def test_an_entry_in_use_is_never_moved_and_a_request_waits_while_running_ones_hold_the_blocks():
    cache = PrefixCache(store(sequences=1), host_budget_bytes=1 << 20, enabled=True)
    first = prompt([1, 2, 3])
    held = cache.claim("a", first, cache.match(first), SHAPE.max_tokens)
    other = prompt([4, 5, 6])
    assert cache.claim("b", other, cache.match(other), 4) is None
    cache.release(held)
    assert cache.claim("b", other, cache.match(other), 4) is not None


def test_a_request_of_more_blocks_than_the_pool_has_fails_at_once():
    cache = PrefixCache(store(blocks=5), host_budget_bytes=0, enabled=True)
    p = prompt([1, 2, 3])
    with pytest.raises(RequestError, match="more than the 16 the device holds"):
        cache.claim("a", p, cache.match(p), 17)


def test_a_request_that_may_outgrow_the_pool_fails_at_once_whatever_it_claims_first():
    cache = PrefixCache(store(blocks=5), host_budget_bytes=0, enabled=True)
    p = prompt([1, 2, 3])
    with pytest.raises(RequestError, match="needs 17 tokens of KV, more than the 16 the device holds"):
        cache.claim("a", p, cache.match(p), 4, at_most=17)


def test_a_growing_request_takes_free_blocks_then_moves_idle_entries_and_fails_only_against_running_ones():
    kv = store(blocks=7)  # 6 usable blocks, 24 rows
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "idle", prompt([1, 2, 3, 4, 5]))  # 2 blocks, idle
    held = cache.claim("held", prompt([6, 7, 8]), cache.match(prompt([6, 7, 8])), 4)  # 1 block, running
    growing = cache.claim("grows", prompt([9, 10]), cache.match(prompt([9, 10])), 4)
    table = growing.entry.table

    assert cache.grow(growing, 12) and len(table) == 3 and cache.entry("idle").table is not None
    assert cache.grow(growing, 20) and len(table) == 5  # in place, the idle entry moved to host for it
    assert cache.entry("idle").host is not None
    assert not cache.grow(growing, 24)  # the last block is the running request's
    cache.release(held)
    assert cache.grow(growing, 24) and len(table) == 6


def test_a_parked_request_keeps_its_rows_in_host_memory_past_the_budget_and_resumes_them_in_fresh_blocks():
    kv = store(sequences=1)
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)  # no host tier: parking is not caching
    p = prompt([1, 2, 3, 4, 5])
    claim = cache.claim("a", p, cache.match(p), 8)
    first, second = claim.entry.table
    fill(kv, first, 3.0)
    fill(kv, second, 4.0)
    cache.publish(claim, p, [6, 7], 6)

    cache.park(claim, 6)

    assert claim.entry.table is None and kv.pool.free == kv.pool.usable and cache.entry("a") is not None
    run(cache, "b", prompt([9, 9, 9]), rows=SHAPE.max_tokens)  # every block, then given back
    assert claim.entry.host is not None, "a parked request's rows are never dropped"
    assert cache.resume(claim, 12)
    table = claim.entry.table
    assert len(table) == 3 and claim.entry.host is None
    rows = torch.cat([kv.keys[0][b] for b in table], dim=1)[0]  # [rows, head_dim]
    assert torch.equal(rows[:6], torch.tensor([[3.0, 3.0]] * 4 + [[4.0, 4.0]] * 2))


def test_a_parked_request_waits_for_blocks_running_requests_hold_and_ends_with_its_entry_on_host():
    kv = store(sequences=1)
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    p = prompt([1, 2, 3])
    claim = cache.claim("a", p, cache.match(p), 4)
    cache.publish(claim, p, [], 3)
    cache.park(claim, 3)
    other = cache.claim("b", prompt([4, 5]), cache.match(prompt([4, 5])), SHAPE.max_tokens)
    assert not cache.resume(claim, 4)
    cache.release(claim)  # cancelled while parked
    cache.release(other)
    assert cache.match(prompt([1, 2, 3, 4])).length == 3 and cache.entry("a").host is not None


def test_past_the_host_arena_the_oldest_entries_are_dropped():
    block_bytes = SHAPE.block_bytes(torch.float32)
    cache = PrefixCache(store(sequences=1), host_budget_bytes=block_bytes, enabled=True)  # one block
    for session, ids in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        run(cache, session, prompt(ids), rows=SHAPE.max_tokens)
    assert cache.arena.blocks == 1 and cache.host_bytes == block_bytes
    assert {e.session for e in cache.entries.values()} == {"b", "c"}  # "a" moved to host, then made room for "b"


def test_with_the_cache_off_nothing_is_kept_and_nothing_matches():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=False)
    run(cache, "a", prompt([1, 2, 3, 4, 5, 6]))
    assert cache.entries == {} and kv.pool.free == kv.pool.usable
    assert cache.match(prompt([1, 2, 3, 4, 5, 6])).length == 0


def test_when_the_match_holds_the_blocks_needed_it_moves_to_host_and_is_read_back_from_there():
    kv = store(sequences=1)
    cache = PrefixCache(kv, host_budget_bytes=1 << 20, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5, 6]))
    p = prompt([1, 2, 3, 4, 5, 9])
    claim = cache.claim("b", p, cache.match(p, "b"), SHAPE.max_tokens)
    assert claim is not None and claim.reused_host == 5
    assert cache.entry("a").host is not None


def test_when_the_match_holds_the_blocks_needed_and_host_memory_is_off_it_is_dropped_and_nothing_is_reused():
    cache = PrefixCache(store(sequences=1), host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4]))
    p = prompt([1, 2, 3, 9])
    claim = cache.claim("b", p, cache.match(p), SHAPE.max_tokens)
    assert claim is not None and claim.start == 0
    assert cache.entry("a") is None


def test_a_request_gives_back_the_blocks_it_did_not_write():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    run(cache, "a", prompt([1, 2, 3, 4, 5]), rows=SHAPE.max_tokens)
    assert len(cache.entry("a").table) == 2 and kv.pool.held == 2


def test_talker_rows_travel_with_their_kv_between_blocks_and_to_host_and_back():
    shape = KVShape(num_layers=2, kv_heads=1, head_dim=2, max_tokens=8, talker_dim=3, block_tokens=4)
    kv = store(sequences=2, shape=shape)
    source, copy = kv.take(2), kv.take(2)
    for layer in kv.keys + kv.values:
        layer[source] = torch.randn(layer[source].shape)
    kv.talker_rows[source] = torch.randn(2, 4, 3)
    kv.copy_block(source[1], copy[1], rows=1)
    assert torch.equal(kv.talker_rows[copy[1], :1], kv.talker_rows[source[1], :1])
    moved = kv.to_host(source, rows=5)
    assert moved.nbytes == 5 * kv.token_bytes
    expected = [layer[source].transpose(0, 1).flatten(1, 2)[:, :5].clone() for layer in kv.keys + kv.values]
    rows = kv.talker_rows[source].flatten(0, 1)[:5].clone()
    for tensor in [*kv.keys, *kv.values, kv.talker_rows]:
        tensor.zero_()  # the blocks go to other chats, which overwrite them
    kv.from_host(moved, copy, rows=5)
    assert torch.equal(kv.talker_rows[copy].flatten(0, 1)[:5], rows)
    assert all(torch.equal(layer[copy].transpose(0, 1).flatten(1, 2)[:, :5], want)
               for layer, want in zip(kv.keys + kv.values, expected))


@pytest.mark.parametrize("talker_dim", [0, 1024], ids=["text", "with speech"])
def test_at_full_size_4_gib_of_blocks_hold_40_chats_of_1000_tokens_at_once(talker_dim):
    # Qwen3-Omni's Thinker: 48 layers of 4 kv heads of 128 in bfloat16 (96 KiB a token), and with
    # speech the Talker row of 1,024 kept per token. Never touched, so the CPU gives it no memory.
    shape = KVShape(num_layers=48, kv_heads=4, head_dim=128, max_tokens=8192, talker_dim=talker_dim)
    kv = KVStore.for_budget(shape, 4 << 30, torch.bfloat16, torch.device("cpu"))
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    for chat in range(40):
        p = prompt([chat * 10_000 + i for i in range(976)])  # a chat's own 976 tokens ...
        run(cache, f"chat {chat}", p, reply=list(range(25)))  # ... and a reply of 25 (24 of them written)
    assert all(entry.table is not None and entry.length == 1000 for entry in cache.entries.values())
    assert len(cache.entries) == 40 and kv.pool.held == 40 * 63  # 63 blocks of 16 hold 1,000 tokens


def test_a_discarded_request_keeps_the_blocks_another_chat_shares_and_zeroes_its_own():
    kv = store()
    cache = PrefixCache(kv, host_budget_bytes=0, enabled=True)
    p = prompt([1, 2, 3, 4, 5, 6, 7, 8, 9])
    claim = cache.claim("a", p, cache.match(p), 16)
    for layer in kv.keys + kv.values:
        layer[claim.entry.table] = 1.0
    cache.publish(claim, p, [], p.num_tokens)  # its prompt checked and published: two full blocks
    other = prompt([1, 2, 3, 4, 5, 6, 7, 8, 10])
    shared = run(cache, "b", other)  # another chat shares them
    assert shared == 8
    cache.discard(claim)  # "a"'s reply then turned out not to be numbers
    kept = cache.entry("b").table[:2]
    assert all(bool((layer[kept] == 1.0).all()) for layer in kv.keys + kv.values)
    assert kv.pool.lookup(chain(other.keys, [], 4, 2, principal_salt(LOCAL_USER))) == kept
    assert cache.entry("a") is None


def test_the_source_of_a_match_is_never_moved_while_a_running_request_holds_it():
    cache = PrefixCache(store(sequences=1), host_budget_bytes=1 << 20, enabled=True)
    first = prompt([1, 2, 3, 4, 5])
    running = cache.claim("a", first, cache.match(first), 24)
    cache.publish(running, first, [], 5)  # published while it still runs
    p = prompt([1, 2, 3, 4, 5, 6])
    assert cache.claim("b", p, cache.match(p), 16) is None  # it waits: "a" holds 24 of 32 rows
    assert running.entry.table is not None and running.entry.pins == 1


def test_another_principals_prompt_is_matched_neither_by_entry_nor_by_hash():
    cache = PrefixCache(store(sequences=3), host_budget_bytes=0, enabled=True)
    system = list(range(100, 109))  # two full blocks and one token
    run(cache, "a", prompt(system + [1]), principal="api key ada")
    guess = prompt(system + [1, 2])
    assert cache.match(guess, "b", principal="api key bob") == Match(None, 0)
    assert cache.match(guess, "b", principal="api key ada").length == 10  # Ada's own second chat
    cache._drop(cache.entry("a", "api key ada"))  # its blocks free now, still found by hash
    assert cache.match(guess, "b", principal="api key bob") == Match(None, 0)
    assert cache.match(guess, "b", principal="api key ada").length == 8
    assert run(cache, "b", guess, principal="api key bob") == 0


def test_two_principals_sessions_of_the_same_id_are_entries_of_their_own():
    cache = PrefixCache(store(sequences=3), host_budget_bytes=0, enabled=True)
    run(cache, "chat", prompt([1, 2, 3, 4, 5, 6]), principal="page user ada")
    assert run(cache, "chat", prompt([1, 2, 3, 4, 5, 6, 7]), principal="page user bob") == 0
    ada, bob = cache.entry("chat", "page user ada"), cache.entry("chat", "page user bob")
    assert ada.length == 6 and bob.length == 7 and not set(ada.table) & set(bob.table)
    assert cache.entry("chat") is None  # nor the local user's
