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
    digest = hashlib.sha256()
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
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

    # ---- prefix cache ---------------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its current tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            index = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[index * bs:(index + 1) * bs],
                                            self._extra_keys(request, index)))

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
                # Most decodes fill no block: skip the publishing call unless one may have filled.
                if self.enable_prefix_caching and \
                        total_tokens >= (self._num_published.get(rid, 0) + 1) * self.block_size:
                    self._publish_full_blocks(request, blocks, total_tokens)
                return True
        elif blocks is None:
            blocks = self._req_blocks[rid] = []
        cached_blocks = cached_blocks if cached_blocks is not None else []
        admission = not blocks and request.num_computed_tokens == 0
        if cached_blocks and not admission:
            raise ValueError(f"request {rid!r} already holds KV blocks; prefix hits apply only on admission")
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(blocks) - len(cached_blocks)
        # Idle cached hits sit in the free queue too: taking them shrinks what is left to allocate.
        num_idle_hits = sum(1 for block in cached_blocks if block.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_idle_hits > self.block_pool.num_free_blocks:
            if not blocks:
                del self._req_blocks[rid]
            return False

        if admission and self.enable_prefix_caching and request.read_prefix_cache:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached_blocks) * self.block_size
        # Touch hits before allocating so the allocation cannot evict them.
        self.block_pool.touch(cached_blocks)
        num_held = len(blocks)
        blocks.extend(cached_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        # Extend in place rather than rebuild the list each step (the runner likewise writes only the
        # new tail of a block-table row); rebuild only if someone else replaced request.block_ids.
        if len(request.block_ids) == num_held:
            request.block_ids.extend(block.block_id for block in blocks[num_held:])
        else:
            request.block_ids = [block.block_id for block in blocks]
        self._publish_full_blocks(request, blocks, total_tokens)
        return True

    def _publish_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Offer the blocks that are full once `num_tokens` tokens are computed to the prefix cache."""
        if not (self.enable_prefix_caching and request.publish_prefix_cache):
            return
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for index in range(start, num_full):
            self.block_pool.cache_block(blocks[index], request.block_hashes[index])
        self._num_published[request.request_id] = num_full

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Release a request's blocks, tail first so its tail blocks are evicted first. With
        keep_cached=False (the request failed, its KV may be wrong) idle blocks are unpublished."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks), keep_cached=keep_cached)
        request.block_ids = []

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_prefix_cache()
