"""The pool of physical KV cache blocks: reference counts, the LRU free queue and the prefix-cache map.

Block 0 is reserved as the null block: it is never handed out, so the runner may pad block tables
with 0 and any stray write through padding lands in a block no request reads. The pool therefore
serves `num_blocks - 1` usable blocks.

Free queue order decides eviction. Allocation takes blocks from the head. A freed block whose KV is
published in the prefix cache goes to the tail (most recently used, evicted last); a freed block
without a hash goes to the head, because its contents are worthless and reusing it first spares a
cached block. The queue is an OrderedDict keyed by block id, so a prefix hit can take a block out of
the middle in O(1).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from pellucid.logger import get_logger

logger = get_logger(__name__)

BlockHash = bytes   # chained digest of a full block's tokens; see kv_cache_manager.hash_block_tokens

NULL_BLOCK_ID = 0


class KVBlock:
    """One physical block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0                          # requests holding this block
        self.block_hash: BlockHash | None = None  # set while the block is published in the prefix cache

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks if block.block_id != NULL_BLOCK_ID)
        self._cached: dict[BlockHash, KVBlock] = {}

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, including cached ones that allocation may evict."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0."""
        return self.num_usable_blocks - len(self._free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ---- allocation -----------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their cached hashes."""
        if num_blocks > len(self._free_queue):
            raise RuntimeError(f"asked for {num_blocks} KV blocks but only {len(self._free_queue)} are free; "
                               "callers must check num_free_blocks first")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock], keep_cached: bool = True) -> None:
        """Drop one reference from each block, in the order given: blocks reaching zero and still
        cached join the tail in that order (so callers pass a request's blocks last-first, making its
        tail blocks the first to be evicted). With keep_cached=False their hashes are dropped."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if not keep_cached:
                self._evict(block)
            self._free_queue[block.block_id] = block
            if block.block_hash is None:
                self._free_queue.move_to_end(block.block_id, last=False)

    # ---- prefix cache ---------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Publish a full, held block under its hash. Returns False when it is already published or
        another block already holds the same contents (that one stays the canonical copy)."""
        if not self.enable_prefix_caching:
            raise RuntimeError("cache_block called with prefix caching disabled")
        if block.ref_cnt <= 0:
            raise RuntimeError(f"cannot publish {block!r}: it is not held by any request")
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every published hash (held blocks keep their KV, they just stop being shareable).
        Returns how many blocks were unpublished."""
        count = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        # Idle blocks stay where they are in the free queue: all of them are hash-less now, so their
        # order no longer protects anything.
        logger.info("prefix cache reset: %d blocks unpublished", count)
        return count

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
