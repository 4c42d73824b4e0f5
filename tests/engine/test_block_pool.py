"""BlockPool against a brute-force list model of the free queue and the prefix-cache map."""
from __future__ import annotations

import random

import pytest

from pellucid.engine.block_pool import NULL_BLOCK_ID, BlockPool


class ReferencePool:
    """The same policy written the slow, obvious way: a Python list for the free queue."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(1, num_blocks))   # head first
        self.ref = {i: 0 for i in range(1, num_blocks)}
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    def evict(self, block_id: int) -> None:
        if block_id in self.hash_of:
            del self.block_of[self.hash_of.pop(block_id)]

    def allocate(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        for b in taken:
            self.evict(b)
            self.ref[b] = 1
        return taken

    def touch(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.free.append(b)
            else:
                self.free.insert(0, b)

    def publish(self, b: int, h: bytes) -> bool:
        if b in self.hash_of or h in self.block_of:
            return False
        self.hash_of[b] = h
        self.block_of[h] = b
        return True


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.randint(4, 24)
    pool, ref = BlockPool(num_blocks, enable_prefix_caching=True), ReferencePool(num_blocks)
    held: list[int] = []   # one entry per reference we hold
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(0, pool.num_free_blocks)
            got = [b.block_id for b in pool.get_new_blocks(n)]
            assert got == ref.allocate(n)
            held += got
        elif op < 0.6 and held:
            b = held.pop(rng.randrange(len(held)))
            pool.free_blocks([pool.blocks[b]])
            ref.release(b)
        elif op < 0.8 and held:
            b = rng.choice(held)
            h = bytes([rng.randrange(6)])   # few distinct hashes, so duplicates happen
            assert pool.cache_block(pool.blocks[b], h) == ref.publish(b, h)
        else:
            h = bytes([rng.randrange(6)])
            block = pool.get_cached_block(h)
            assert (block.block_id if block else None) == ref.block_of.get(h)
            if block is not None:
                pool.touch([block])
                ref.touch(block.block_id)
                held.append(block.block_id)
        assert list(pool._free_queue) == ref.free
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == ref.ref
        assert {h: b.block_id for h, b in pool._cached.items()} == ref.block_of
        assert pool.num_used_blocks == sum(1 for c in ref.ref.values() if c > 0)
        assert pool.usage == pytest.approx(pool.num_used_blocks / (num_blocks - 1))
    pool.free_blocks([pool.blocks[b] for b in held])
    assert pool.num_free_blocks == num_blocks - 1 and pool.num_used_blocks == 0


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(8, enable_prefix_caching=False)
    ids = [b.block_id for b in pool.get_new_blocks(7)]
    assert NULL_BLOCK_ID not in ids and sorted(ids) == list(range(1, 8))
    with pytest.raises(RuntimeError, match="only 0 are free"):
        pool.get_new_blocks(1)
    assert pool.usage == 1.0


def test_lru_eviction_order_of_cached_blocks() -> None:
    pool = BlockPool(6, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(5)
    for i, block in enumerate(blocks[:4]):
        assert pool.cache_block(block, bytes([i]))
    # Free cached blocks in the order 2, 0, 3, 1 and the uncached block 5 last.
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1], blocks[4]])
    assert pool.num_cached_blocks == 4
    # The hash-less block goes first, then cached blocks least recently freed first.
    order = [pool.get_new_blocks(1)[0].block_id for _ in range(5)]
    assert order == [blocks[4].block_id, blocks[2].block_id, blocks[0].block_id,
                     blocks[3].block_id, blocks[1].block_id]
    assert pool.num_cached_blocks == 0


def test_touch_revives_cached_block_and_protects_it() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free_blocks([a, b, c])
    hit = pool.get_cached_block(b"a")
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    new = pool.get_new_blocks(2)   # c (uncached) then b (evicted), never the touched a
    assert [x.block_id for x in new] == [c.block_id, b.block_id]
    assert pool.get_cached_block(b"b") is None and pool.get_cached_block(b"a") is a


def test_double_free_and_publish_rules() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"x")
    assert not pool.cache_block(a, b"y")          # already published
    assert not pool.cache_block(b, b"x")          # same contents already cached in a
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="not held"):
        pool.cache_block(a, b"z")


def test_free_without_keeping_cache_unpublishes() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.touch([a])
    pool.free_blocks([a, b], keep_cached=False)
    assert pool.get_cached_block(b"a") is a        # still held once: keeps its hash
    assert pool.get_cached_block(b"b") is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(5, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]))
    pool.free_blocks(blocks[:2])
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)
    assert pool.num_used_blocks == 1


def test_prefix_caching_disabled_never_hits() -> None:
    pool = BlockPool(4, enable_prefix_caching=False)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="disabled"):
        pool.cache_block(a, b"a")
    assert pool.get_cached_block(b"a") is None


def test_too_small_pool_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, enable_prefix_caching=True)
