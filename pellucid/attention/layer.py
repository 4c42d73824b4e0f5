"""The attention op inside a model: store the new keys/values in the paged cache, then attend.

Per-step state (cache tensors, metadata, backend) comes from the forward context, so the model code
stays the same for every backend and for eager or CUDA-graph execution.
"""
from __future__ import annotations

import torch
from torch import nn

from pellucid.attention.fused_kv_store import FusedKVStore
from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales, is_fp8
from pellucid.attention.metadata import get_forward_context
from pellucid.attention.norm_rotary import QKNormRotary


class Attention(nn.Module):
    """Causal paged attention for one decoder layer (`layer_idx` picks its KV cache).

    `kv_scales`: the checkpoint's calibrated KV-cache scales for this layer, None where it has none
    (pellucid.models.kv_cache_scales sets them at load). An FP8 cache applies them (1.0 without); a cache in the
    model's dtype does not need them.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = scale
        self.kv_scales: KvScales | None = None

    def plain_kv_target(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this layer's KV cache, the step's slot mapping) when the backend's KV write is the plain store
        another kernel can do instead (fused_kv_store.py); else None."""
        ctx = get_forward_context()
        if not ctx.backend.kv_write_is_plain_store:
            return None
        return ctx.kv_caches[self.layer_idx], ctx.attn_metadata.slot_mapping

    def fused_kv_store(self, value: torch.Tensor) -> FusedKVStore | None:
        """A FusedKVStore for this layer's new values [T, kv_heads(*head_dim)] when the backend's KV write
        is the plain store a rotary kernel can do instead; else None."""
        target = self.plain_kv_target()
        if target is None:
            return None
        return FusedKVStore(value.view(value.shape[0], self.num_kv_heads, self.head_dim), *target)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_store: FusedKVStore | None = None) -> torch.Tensor:
        """query [T, heads(*head_dim)], key/value [T, kv_heads(*head_dim)] -> [T, heads * head_dim]. The new
        keys and values are written to the cache here unless `kv_store` says a kernel stored them already."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        kv_scales = self.kv_scales if self.kv_scales is not None and is_fp8(kv_cache.dtype) else UNIT_KV_SCALES
        if kv_store is None or not kv_store.stored:
            ctx.backend.write_kv(key, value, kv_cache, ctx.attn_metadata.slot_mapping, kv_scales)
        output = ctx.backend.forward(query, kv_cache, ctx.backend_metadata, self.scale, kv_scales)
        return output.reshape(num_tokens, self.num_heads * self.head_dim)

    def fuses_qk_norm_rotary(self) -> bool:
        """True when this step's backend applies Qwen3's q/k norm + rotary itself (`forward_qk_norm_rotary`)."""
        ctx = get_forward_context()
        return ctx.backend.fuses_qk_norm_rotary(ctx.backend_metadata)

    def forward_qk_norm_rotary(self, query: torch.Tensor, norm_rotary: QKNormRotary) -> torch.Tensor:
        """`forward` on the raw query [T, heads(*head_dim)] and norm_rotary's raw keys and values: the backend
        norms and rotates them and stores the keys and values in the cache (pellucid.attention.norm_rotary)."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        ctx = get_forward_context()
        output = ctx.backend.forward_qk_norm_rotary(query, ctx.kv_caches[self.layer_idx], ctx.backend_metadata,
                                                    self.scale, norm_rotary)
        return output.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        scales = "" if self.kv_scales is None else f", k_scale={self.kv_scales.k:.4g}, v_scale={self.kv_scales.v:.4g}"
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, scale={self.scale:.4g}{scales}")
