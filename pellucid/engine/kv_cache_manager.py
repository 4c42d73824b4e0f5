"""Per-request KV block bookkeeping on top of the BlockPool: allocation, prefix-cache lookup and publishing.

A full block is identified by a chained hash: digest(parent block's hash, the block's token ids, extra
keys), so equal hashes mean equal whole prefixes, not just equal blocks. Hashes are SHA-256 digests:
a collision would silently hand one request another's KV, so a 64-bit Python hash is not enough.

Publishing happens at allocation time for the blocks this step fills, as in vLLM. A later request in
the same step may hit such a block; that is sound because every backend writes the whole step's KV
(write_kv) before any attention reads it (see attention/backend.py).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Any, Sequence

from pellucid.engine.block_pool import BlockHash, BlockPool, KVBlock
from pellucid.engine.request import CACHE_SALT_KEY, Request


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] = ()) -> BlockHash:
    """Digest of one full block chained on its parent. Token bytes have a fixed width per block and
    the parent a fixed width (or none for the first block), so the encoding is unambiguous."""
    digest = hashlib.sha256(parent) if parent is not None else hashlib.sha256()
    digest.update(array("q", token_ids))
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if enable_prefix_caching and not block_pool.enable_prefix_caching:
            raise ValueError("prefix caching is enabled in the manager but not in its BlockPool")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}   # leading blocks of a request already offered to the cache
        # request id -> the most computed tokens the request may reach with allocate_slots doing nothing but
        # returning True: no new block, no block to publish. See no_work_limits.
        self._no_work_limits: dict[str, int] = {}
        # Counters in tokens, for metrics: tokens looked up on admission and tokens found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizing ---------------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of this length fits in the pool with every other request gone."""
        return self.blocks_needed(num_tokens) <= self.block_pool.num_usable_blocks

    def get_blocks(self, request: Request) -> list[KVBlock]:
        return self._req_blocks.get(request.request_id, [])

    @property
    def no_work_limits(self) -> dict[str, int]:
        """request id -> the most computed tokens (num_computed_tokens + new tokens) for which
        allocate_slots(request, ...) without cached blocks would change nothing and return True.

        Read-only for callers. The scheduler's decode loop checks it to skip the call: at a batch of
        hundreds of decodes, the call is a large part of a step's host time. A request missing here
        must go through allocate_slots."""
        return self._no_work_limits

    def _update_no_work_limit(self, request: Request, blocks: list[KVBlock]) -> None:
        rid = request.request_id
        limit = len(blocks) * self.block_size
        if self.enable_prefix_caching and request.publish_prefix_cache:
            # One token short of filling the next unpublished block: from there on a call may publish.
            limit = min(limit, (self._num_published.get(rid, 0) + 1) * self.block_size - 1)
        self._no_work_limits[rid] = limit

    # ---- prefix cache ---------------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its current tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        index = len(hashes)
        while (index + 1) * bs <= len(tokens):
            parent = hashes[-1] if index else None
            extra_keys = self._extra_keys(request, index) if index == 0 else ()
            hashes.append(hash_block_tokens(parent, tokens[index * bs:(index + 1) * bs], extra_keys))
            index += 1

    def _extra_keys(self, request: Request, block_index: int) -> tuple[Any, ...]:
        # Only the first block carries the salt: chaining carries it into every later hash.
        salt = request.extras.get(CACHE_SALT_KEY)
        return ("salt", salt) if block_index == 0 and salt is not None else ()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet, as (blocks, num_tokens).

        Never covers the last token: it must be computed so the step produces its logits."""
        if not (self.enable_prefix_caching and request.read_prefix_cache):
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.prefix_cache_read_limit is not None:
            max_blocks = min(max_blocks, request.prefix_cache_read_limit // self.block_size)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after request.num_computed_tokens, or, on a
        request's admission, after its prefix-cache hits `cached_blocks` (as returned by
        get_computed_blocks; request.num_computed_tokens is still 0 then). Returns False, changing
        nothing, when the pool cannot supply the blocks."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if blocks and cached_blocks is None:
            # Fast path, taken by nearly every decode: the held blocks already have room.
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(blocks) * self.block_size:
                # Most decodes fill no block: skip the publishing call unless one filled. A block whose
                # last token is still pending (async scheduling) is full only once that token is known.
                if self.enable_prefix_caching and min(total_tokens, len(request.all_token_ids)) >= \
                        (self._num_published.get(rid, 0) + 1) * self.block_size:
                    self._publish_full_blocks(request, blocks, total_tokens)
                    self._update_no_work_limit(request, blocks)
                return True
            # Growth past the held blocks (a decode filled its last one): new blocks, no prefix hits.
            num_new_blocks = -(-total_tokens // self.block_size) - len(blocks)
            if num_new_blocks > self.block_pool.num_free_blocks:
                return False
            num_held = len(blocks)
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
            self._extend_block_ids(request, blocks, num_held)
            self._publish_full_blocks(request, blocks, total_tokens)
            self._update_no_work_limit(request, blocks)
            return True
        if blocks is None:
            blocks = self._req_blocks[rid] = []
        cached_blocks = cached_blocks if cached_blocks is not None else []
        admission = not blocks and request.num_computed_tokens == 0
        if cached_blocks and not admission:
            raise ValueError(f"request {rid!r} already holds KV blocks; prefix hits apply only on admission")
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(cached_blocks) * bs
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = -(-total_tokens // bs) - len(blocks) - len(cached_blocks)
        # Idle cached hits sit in the free queue too: taking them shrinks what is left to allocate.
        num_idle_hits = sum(1 for block in cached_blocks if block.ref_cnt == 0) if cached_blocks else 0
        if max(num_new_blocks, 0) + num_idle_hits > self.block_pool.num_free_blocks:
            if not blocks:
                del self._req_blocks[rid]
            return False

        num_held = len(blocks)
        if cached_blocks:
            if admission and self.enable_prefix_caching and request.read_prefix_cache:
                self.prefix_cache_hits += len(cached_blocks) * bs
            # Touch hits before allocating so the allocation cannot evict them.
            self.block_pool.touch(cached_blocks)
            blocks.extend(cached_blocks)
        if admission and self.enable_prefix_caching and request.read_prefix_cache:
            self.prefix_cache_queries += request.num_tokens
        if num_new_blocks > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self._extend_block_ids(request, blocks, num_held)
        self._publish_full_blocks(request, blocks, total_tokens)
        self._update_no_work_limit(request, blocks)
        return True

    @staticmethod
    def _extend_block_ids(request: Request, blocks: list[KVBlock], num_held: int) -> None:
        """Mirror `blocks` (num_held of them were held before) in request.block_ids. Extend in place
        rather than rebuild the list each step (the runner likewise writes only the new tail of a
        block-table row); rebuild only if someone else replaced request.block_ids."""
        if len(request.block_ids) == num_held:
            request.block_ids.extend([block.block_id for block in blocks[num_held:]])
        else:
            request.block_ids = [block.block_id for block in blocks]

    def _publish_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Offer the blocks that are full once `num_tokens` tokens are computed to the prefix cache."""
        if not (self.enable_prefix_caching and request.publish_prefix_cache):
            return
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        if len(request.block_hashes) < num_full:
            self.update_block_hashes(request)
        hashes = request.block_hashes
        cache_block = self.block_pool.cache_block
        for index in range(start, num_full):
            cache_block(blocks[index], hashes[index])
        self._num_published[request.request_id] = num_full

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Release a request's blocks, tail first so its tail blocks are evicted first. With
        keep_cached=False (the request failed, its KV may be wrong) idle blocks are unpublished."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self._no_work_limits.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks), keep_cached=keep_cached)
        request.block_ids = []

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_prefix_cache()
