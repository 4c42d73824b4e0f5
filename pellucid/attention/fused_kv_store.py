"""Storing a layer's new keys and values from the kernel that finishes the keys, instead of a KV-write launch.

In a decode step the rotary kernel (or Qwen3's q/k norm + rotary) is the last kernel to touch the keys
before attention. When the backend's `write_kv` is the plain store into the standard cache layout
(`AttentionBackend.kv_write_is_plain_store`) and nothing observes the attention or rotary modules, the
decoder layer hands the rotary kernel a `FusedKVStore`: the kernel stores the rotated keys and the values
at their slots, sets `stored`, and the attention layer skips its write_kv. One dependent launch fewer per
layer (see BENCHMARKS.md, round 5). Whatever does not run the fused kernel leaves `stored` False, and the
attention layer writes the cache as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FusedKVStore:
    value: torch.Tensor           # [T, kv_heads, head_dim], the head dim contiguous
    kv_cache: torch.Tensor        # [2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor    # [>= T]; slot -1 (CUDA-graph padding) is not written
    stored: bool = False          # set by the kernel that stored them
