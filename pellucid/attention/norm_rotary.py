"""Qwen3's q/k RMSNorm + rotary handed to the attention backend, for backends that apply it inside attention.

In a decode step the q/k norm + rotary kernel (pellucid.kernels.qk_norm_rotary) runs between the q/k/v
projection and attention, one dependent launch of a few microseconds per layer with almost no bytes to
move. A backend that says so (`AttentionBackend.fuses_qk_norm_rotary`) takes the raw projections with a
QKNormRotary instead: it norms and rotates the query heads and the new keys in its own programs and stores
the new keys and values in the cache itself. The decoder layer uses it only while nothing observes the
modules it skips (q_norm, k_norm, rotary_emb, attn), as the other fusions do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QKNormRotary:
    key: torch.Tensor             # [T, kv_heads, head_dim] raw (before k_norm), the head dim contiguous
    value: torch.Tensor           # [T, kv_heads, head_dim], the head dim contiguous
    q_weight: torch.Tensor        # q_norm's weight [head_dim], the activation dtype
    k_weight: torch.Tensor        # k_norm's weight [head_dim]
    q_eps: float
    k_eps: float
    cos_sin_cache: torch.Tensor   # [2, max_positions, head_dim] float32 (RotaryEmbedding.cos_sin_cache)
    positions: torch.Tensor       # [>= T] int64, each token's position

    def check(self, query: torch.Tensor) -> None:
        """Raise ValueError unless these fit query [T, heads, head_dim]."""
        num_tokens, _, head_dim = query.shape
        kv_shape = (num_tokens, self.key.shape[1], head_dim)
        if self.key.shape != kv_shape or self.value.shape != kv_shape or head_dim % 2:
            raise ValueError(f"q/k norm + rotary in attention needs key and value {kv_shape} and an even head dim, "
                             f"got {tuple(self.key.shape)} and {tuple(self.value.shape)}")
        tensors = (query, self.key, self.value, self.q_weight, self.k_weight)
        if any(t.dtype != query.dtype for t in tensors) or any(t.stride(-1) != 1 for t in tensors):
            raise ValueError("q/k norm + rotary in attention needs query, key, value and the norm weights in one "
                             "dtype with the last dim contiguous")
        if self.q_weight.shape != (head_dim,) or self.k_weight.shape != (head_dim,):
            raise ValueError(f"q/k norm weights must be [{head_dim}], got {tuple(self.q_weight.shape)} and "
                             f"{tuple(self.k_weight.shape)}")
        if self.cos_sin_cache.dim() != 3 or self.cos_sin_cache.shape[2] != head_dim \
                or self.cos_sin_cache.stride(-1) != 1 or self.positions.shape[0] < num_tokens:
            raise ValueError("q/k norm + rotary in attention needs a contiguous [2, positions, head_dim] cos/sin "
                             "table and one position per token")
