"""KVCacheManager: chained hashes, prefix lookups, allocation, publishing policy and freeing order."""
from __future__ import annotations

import random

import pytest

from pellucid.engine.block_pool import BlockPool
from pellucid.engine.kv_cache_manager import CACHE_SALT_KEY, KVCacheManager
from pellucid.engine.request import Request
from pellucid.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 32, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, prefix), BS, prefix)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_model_len=1000)


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admit a request whole, as the scheduler does; returns its cached tokens."""
    blocks, num_cached = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_cached, blocks)
    r.num_computed_tokens = r.num_tokens
    return num_cached


@pytest.mark.parametrize("seed", range(4))
def test_block_hashes_equal_iff_whole_prefixes_equal(seed: int) -> None:
    rng = random.Random(seed)
    kv = make()
    bases = [[rng.randrange(5) for _ in range(24)] for _ in range(3)]
    requests = []
    for i in range(12):
        cut = rng.randint(0, 24)
        tokens = rng.choice(bases)[:cut] + [rng.randrange(5) for _ in range(rng.randint(1, 12))]
        r = req(f"r{i}", tokens)
        kv.update_block_hashes(r)
        assert len(r.block_hashes) == len(tokens) // BS
        requests.append(r)
    for a in requests:
        for b in requests:
            for i in range(min(len(a.block_hashes), len(b.block_hashes))):
                same_prefix = a.all_token_ids[:(i + 1) * BS] == b.all_token_ids[:(i + 1) * BS]
                assert (a.block_hashes[i] == b.block_hashes[i]) == same_prefix


def test_hashes_are_incremental_and_salted() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(100) for _ in range(21)]
    grown = req("a", tokens[:6])
    kv = make()
    kv.update_block_hashes(grown)
    for t in tokens[6:]:
        grown.append_output_token(t)
        kv.update_block_hashes(grown)
    fresh = req("b", tokens)
    kv.update_block_hashes(fresh)
    assert grown.block_hashes == fresh.block_hashes and len(fresh.block_hashes) == 5
    salted = req("c", tokens)
    salted.extras[CACHE_SALT_KEY] = "tenant-1"
    kv.update_block_hashes(salted)
    assert not set(salted.block_hashes) & set(fresh.block_hashes)


@pytest.mark.parametrize("seed", range(3))
def test_shared_prefix_hits_and_last_token_rule(seed: int) -> None:
    rng = random.Random(seed)
    kv = make()
    prefix = [rng.randrange(100) for _ in range(3 * BS)]
    a = req("a", prefix + [rng.randrange(100) for _ in range(3)])
    assert admit(kv, a) == 0
    b = req("b", prefix + [rng.randrange(100) for _ in range(5)])
    assert admit(kv, b) == 3 * BS
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3:] != a.block_ids[3:]
    # A prompt equal to the cached prefix still computes its last token: one block less is a hit.
    c = req("c", list(prefix))
    assert admit(kv, c) == 2 * BS
    assert kv.prefix_cache_queries == a.num_tokens + b.num_tokens + c.num_tokens
    assert kv.prefix_cache_hits == 5 * BS
    for r in (a, b, c):
        kv.free(r)
    assert kv.block_pool.num_used_blocks == 0


def test_read_and_publish_flags() -> None:
    tokens = list(range(3 * BS + 2))
    kv = make()
    no_publish = req("a", tokens)
    no_publish.publish_prefix_cache = False
    admit(kv, no_publish)
    assert kv.block_pool.num_cached_blocks == 0
    publisher = req("b", tokens)
    assert admit(kv, publisher) == 0
    assert kv.block_pool.num_cached_blocks == 3
    no_read = req("c", tokens)
    no_read.read_prefix_cache = False
    assert kv.get_computed_blocks(no_read) == ([], 0)
    assert admit(kv, no_read) == 0
    assert not set(no_read.block_ids) & set(publisher.block_ids)
    assert kv.prefix_cache_queries == 2 * len(tokens)   # the no-read request made no lookup


def test_publishes_only_blocks_filled_so_far() -> None:
    kv = make()
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 6)                    # chunk of 6: one full block
    r.num_computed_tokens = 6
    assert kv.block_pool.num_cached_blocks == 1 and len(r.block_ids) == 2
    assert kv.allocate_slots(r, 4)                    # rest of the prompt: two full blocks
    r.num_computed_tokens = 10
    assert kv.block_pool.num_cached_blocks == 2 and len(r.block_ids) == 3
    r.append_output_token(7)
    r.append_output_token(8)
    assert kv.allocate_slots(r, 2)                    # decode tokens fill block 3
    assert kv.block_pool.num_cached_blocks == 3
    other = req("b", list(range(10)) + [7, 8, 9])
    blocks, n = kv.get_computed_blocks(other)
    assert n == 12 and [b.block_id for b in blocks] == r.block_ids[:3]


def test_allocation_failure_changes_nothing() -> None:
    kv = make(num_blocks=5)                            # 4 usable blocks
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)                     # 3 blocks
    a.num_computed_tokens = 9
    b = req("b", list(range(100, 106)))
    free_before = kv.block_pool.num_free_blocks
    assert not kv.allocate_slots(b, 6)                 # needs 2, 1 free
    assert kv.block_pool.num_free_blocks == free_before and b.block_ids == [] and kv.get_blocks(b) == []
    assert kv.allocate_slots(b, 4)
    for t in (1, 2, 3, 4):
        a.append_output_token(t)
    assert not kv.allocate_slots(a, 4)                 # 13 tokens need a 4th block; none is left
    assert len(a.block_ids) == 3
    assert kv.allocate_slots(a, 3)                     # 12 tokens still fit in 3 blocks


def test_idle_hits_count_against_free_blocks() -> None:
    kv = make(num_blocks=4)                            # 3 usable blocks
    tokens = list(range(2 * BS + 1))
    a = req("a", tokens)
    admit(kv, a)
    a_ids = list(a.block_ids)
    kv.free(a)                                         # 2 cached idle blocks + 1 uncached, all free
    b = req("b", tokens)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 2 * BS
    assert kv.allocate_slots(b, 1, blocks)             # 2 idle hits + 1 new block = the whole pool
    assert kv.block_pool.num_free_blocks == 0
    assert b.block_ids[:2] == a_ids[:2]
    kv.free(b)
    c = req("c", tokens + list(range(50, 50 + 2 * BS)))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 2 * BS
    assert not kv.allocate_slots(c, c.num_tokens - n, blocks)   # 2 hits + 3 new > 3
    assert kv.block_pool.num_free_blocks == 3 and all(x.ref_cnt == 0 for x in blocks)


def test_free_evicts_tail_blocks_first() -> None:
    kv = make(num_blocks=5)                            # 4 usable blocks
    tokens = list(range(3 * BS + 1))                   # 3 full blocks + 1 token
    a = req("a", tokens)
    admit(kv, a)
    ids = list(a.block_ids)
    kv.free(a)
    # The partial block (not cached) is reused first, then a's last full block, then the one before.
    x = req("x", list(range(500, 500 + 2 * BS)))
    assert kv.allocate_slots(x, 2 * BS)
    assert x.block_ids == [ids[3], ids[2]]
    b = req("b", tokens)
    assert kv.get_computed_blocks(b)[1] == 2 * BS      # blocks 0 and 1 survived
    y = req("y", list(range(600, 600 + BS)))
    assert kv.allocate_slots(y, BS)
    assert y.block_ids == [ids[1]]
    assert kv.get_computed_blocks(b)[1] == BS


def test_free_after_failure_unpublishes() -> None:
    kv = make()
    tokens = list(range(3 * BS + 1))
    a = req("a", tokens)
    admit(kv, a)
    kv.free(a, keep_cached=False)
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(req("b", tokens)) == ([], 0)


def test_prefix_caching_disabled() -> None:
    kv = make(prefix=False)
    tokens = list(range(3 * BS + 1))
    admit(kv, req("a", tokens))
    assert kv.get_computed_blocks(req("b", tokens)) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def _kv_state(kv: KVCacheManager, requests: list[Request]) -> tuple:
    pool = kv.block_pool
    return ([(b.ref_cnt, b.block_hash) for b in pool.blocks], pool.num_free_blocks, pool.num_cached_blocks,
            [(list(r.block_ids), [b.block_id for b in kv.get_blocks(r)], len(r.block_hashes)) for r in requests],
            kv.prefix_cache_queries, kv.prefix_cache_hits)


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_no_work_limit_means_allocate_slots_would_change_nothing(seed: int, prefix: bool) -> None:
    """Below a request's no_work_limits entry, allocate_slots returns True and changes nothing (the
    scheduler skips the call there); checked on random decodes, chunks and pending tokens."""
    rng = random.Random(seed)
    kv = make(num_blocks=48, prefix=prefix)
    shared = [rng.randrange(50) for _ in range(3 * BS)]
    requests: list[Request] = []
    checked = 0
    for step in range(400):
        if len(requests) < 4 and rng.random() < 0.3:
            r = req(f"r{step}", (shared if rng.random() < 0.5 else [])[:rng.randint(0, 3 * BS)]
                    + [rng.randrange(50) for _ in range(rng.randint(1, 10))])
            r.publish_prefix_cache = rng.random() < 0.8
            blocks, num_cached = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - num_cached, blocks):
                r.num_computed_tokens = r.num_tokens
                requests.append(r)
            continue
        if not requests:
            continue
        r = rng.choice(requests)
        if rng.random() < 0.05 or r.num_tokens > 60:
            kv.free(r)
            requests.remove(r)
            assert r.request_id not in kv.no_work_limits
            continue
        if rng.random() < 0.7:
            r.append_output_token(rng.randrange(50))
        pending = 1 if rng.random() < 0.4 else 0      # a token sampled by a step in flight
        num_new = r.num_tokens + pending - r.num_computed_tokens
        if num_new < 1:
            continue
        total = r.num_computed_tokens + num_new
        if total <= kv.no_work_limits.get(r.request_id, 0):
            before = _kv_state(kv, requests)
            assert kv.allocate_slots(r, num_new)
            assert _kv_state(kv, requests) == before
            checked += 1
        elif not kv.allocate_slots(r, num_new):
            continue
        r.num_computed_tokens = total - pending
    assert checked > 50
