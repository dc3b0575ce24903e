"""The block pool's books alone (no tensors, no model): who holds each block, which are free, and
which hold a prefix found by its chained hash."""

import numpy as np
import pytest

from omni_local.access import principal_salt
from omni_local.engine.memory.kv_blocks import PAD_BLOCK, BlockKey, BlockPool, chain

BLOCK = 4


def keys_of(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_blocks_are_handed_out_lowest_first_and_never_the_pad_block():
    pool = BlockPool(blocks=5, block_tokens=BLOCK)
    assert pool.take(4) == [1, 2, 3, 4]
    assert pool.free == 0 and pool.usable == 4
    assert pool.take(1) is None


def test_a_request_for_more_blocks_than_are_free_takes_none():
    pool = BlockPool(blocks=4, block_tokens=BLOCK)
    pool.take(2)
    assert pool.take(2) is None
    assert pool.free == 1


def test_a_block_is_free_only_once_every_holder_has_let_go():
    pool = BlockPool(blocks=3, block_tokens=BLOCK)
    [block] = pool.take(1)
    pool.register(block, chain(keys_of(1, 2, 3, 4), [], BLOCK, 1)[0])
    pool.hold([block])
    assert pool.holders(block) == 2
    pool.release([block])
    assert pool.free == 1 and pool.holders(block) == 1
    pool.release([block])
    assert pool.free == 2 and pool.holders(block) == 0


def test_a_free_registered_block_is_found_by_its_chain_and_held_again():
    pool = BlockPool(blocks=4, block_tokens=BLOCK)
    keys = chain(keys_of(1, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2)
    blocks = pool.take(2)
    for block, key in zip(blocks, keys):
        pool.register(block, key)
    pool.release(blocks)
    assert pool.lookup(keys) == blocks
    pool.hold(blocks)
    assert pool.free == 1


def test_a_chain_is_found_only_as_far_as_its_blocks_agree():
    pool = BlockPool(blocks=4, block_tokens=BLOCK)
    blocks = pool.take(2)
    for block, key in zip(blocks, chain(keys_of(1, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2)):
        pool.register(block, key)
    assert pool.lookup(chain(keys_of(1, 2, 3, 4, 5, 6, 7, 9), [], BLOCK, 2)) == blocks[:1]
    # The same second block after another first one has another hash: the whole prefix is its key.
    assert pool.lookup(chain(keys_of(0, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2)) == []


def test_a_medium_s_full_digest_is_part_of_the_key_of_every_block_it_is_in():
    pool = BlockPool(blocks=4, block_tokens=BLOCK)
    ids = keys_of(1, -5, -6, -7, -8, 6, 7, 8)  # a medium of 4 tokens at 1..5, straddling the boundary
    blocks = pool.take(2)
    for block, key in zip(blocks, chain(ids, [(1, 5, b"A" * 32)], BLOCK, 2)):
        pool.register(block, key)
    assert pool.lookup(chain(ids, [(1, 5, b"A" * 32)], BLOCK, 2)) == blocks
    assert pool.lookup(chain(ids, [(1, 5, b"A" * 31 + b"B")], BLOCK, 2)) == []


def test_a_hit_is_checked_against_the_whole_key_not_its_hash_alone():
    pool = BlockPool(blocks=3, block_tokens=BLOCK)
    [block] = pool.take(1)
    key = chain(keys_of(1, 2, 3, 4), [], BLOCK, 1)[0]
    pool.register(block, key)
    clash = BlockKey(key.parent, keys_of(9, 9, 9, 9).tobytes(), b"")
    pool._by_hash[clash.hash] = block  # as if another key's hash were the same as this block's
    assert pool.lookup([clash]) == []


def test_never_registered_blocks_are_handed_out_before_registered_free_ones_oldest_first():
    pool = BlockPool(blocks=5, block_tokens=BLOCK)
    first, second, plain = pool.take(1), pool.take(1), pool.take(1)
    pool.register(first[0], chain(keys_of(1, 2, 3, 4), [], BLOCK, 1)[0])
    pool.register(second[0], chain(keys_of(5, 6, 7, 8), [], BLOCK, 1)[0])
    pool.release(first)
    pool.release(second)
    pool.release(plain)
    assert sorted(pool.take(2)) == [plain[0], 4]  # never registered: one never used, one used
    assert pool.take(1) == first  # the least recently freed registered block, whose key is forgotten
    assert pool.lookup(chain(keys_of(1, 2, 3, 4), [], BLOCK, 1)) == []
    assert pool.lookup(chain(keys_of(5, 6, 7, 8), [], BLOCK, 1)) == second


def test_a_key_registered_already_keeps_its_first_block():
    pool = BlockPool(blocks=4, block_tokens=BLOCK)
    key = chain(keys_of(1, 2, 3, 4), [], BLOCK, 1)[0]
    one, other = pool.take(1), pool.take(1)
    pool.register(one[0], key)
    pool.register(other[0], key)
    assert pool.lookup([key]) == one and not pool.is_registered(other[0])


def test_an_unregistered_block_is_not_found_and_is_free_as_a_plain_one():
    pool = BlockPool(blocks=3, block_tokens=BLOCK)
    key = chain(keys_of(1, 2, 3, 4), [], BLOCK, 1)[0]
    blocks = pool.take(1)
    pool.register(blocks[0], key)
    pool.release(blocks)
    pool.unregister(blocks)
    assert pool.lookup([key]) == [] and pool.free == 2


def test_the_pad_block_is_never_held():
    pool = BlockPool(blocks=3, block_tokens=BLOCK)
    with pytest.raises(AssertionError):
        pool.hold([PAD_BLOCK])


def test_a_chain_salted_for_one_principal_is_not_found_by_another():
    pool = BlockPool(8, BLOCK)
    ada, bob = principal_salt("api key ada"), principal_salt("api key bob")
    blocks = pool.take(2)
    for block, key in zip(blocks, chain(keys_of(1, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2, ada)):
        pool.register(block, key)
    assert pool.lookup(chain(keys_of(1, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2, ada)) == blocks
    assert pool.lookup(chain(keys_of(1, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2, bob)) == []
    assert pool.lookup(chain(keys_of(1, 2, 3, 4, 5, 6, 7, 8), [], BLOCK, 2)) == []  # nor unsalted
