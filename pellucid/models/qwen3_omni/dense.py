"""Small dense transformer layers on [batch, time, hidden] inputs, for the parts of Qwen3-Omni that are no
paged-KV LLM: the talker's code predictor (a few positions per frame, its own short KV cache) and
code2wav's pre-transformer (a window of frames, sliding-window attention, recomputed per window).

Module names are transformers' (self_attn.q_proj, mlp.gate_proj, input_layernorm, ...); the math is its
eager attention's in float32 (softmax over scaled scores plus the mask), via torch's SDPA.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.models.layers import GatedMLP, RMSNorm, rope_inv_freq


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] at integer positions [T], as transformers' default rotary computes them."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by cos/sin [T, D]."""
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Per-layer keys and values of a short sequence, [B, kv_heads, T_max, D], filled left to right."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0     # positions stored (every layer advances together; see DenseStack.forward)


class DenseAttention(nn.Module):
    """`self_attn`: q/k/v projections, optional per-head q/k RMSNorm (Qwen3), rotary, causal attention over
    the cache (optionally within a sliding window), o_proj."""

    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, sliding_window: int | None,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias, **factory)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory) if qk_norm else None
        self.sliding_window = sliding_window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        start = 0
        if cache is not None:
            start = cache.length
            cache.keys[self.layer_idx][:, :, start:start + t] = k
            cache.values[self.layer_idx][:, :, start:start + t] = v
            k = cache.keys[self.layer_idx][:, :, :start + t]
            v = cache.values[self.layer_idx][:, :, :start + t]
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = self._mask(t, start, x.device)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def _mask(self, t: int, start: int, device: torch.device) -> torch.Tensor:
        """[t, start + t] bool: query i (position start + i) sees keys j <= start + i (within the window)."""
        query = torch.arange(start, start + t, device=device)[:, None]
        key = torch.arange(start + t, device=device)[None, :]
        allowed = key <= query
        if self.sliding_window is not None:
            allowed &= key > query - self.sliding_window
        return allowed


class DenseDecoderLayer(nn.Module):
    """Pre-norm decoder layer; `layer_scale`: code2wav scales each branch's output by a learnt vector."""

    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, sliding_window: int | None, layer_scale: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = DenseAttention(config, layer_idx, qk_norm, sliding_window, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, **factory)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, **factory) if layer_scale else None
        self.mlp_layer_scale = LayerScale(config.hidden_size, **factory) if layer_scale else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache)
        x = x + (self.self_attn_layer_scale(attn) if self.self_attn_layer_scale is not None else attn)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp_layer_scale(mlp) if self.mlp_layer_scale is not None else mlp)


class LayerScale(nn.Module):
    def __init__(self, channels: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class DenseStack(nn.Module):
    """`layers` + `norm` + the rotary table: inputs_embeds [B, T, H] -> normed hidden [B, T, H]."""

    def __init__(self, config: Any, qk_norm: bool, sliding_window: int | None, layer_scale: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseDecoderLayer(config, i, qk_norm, sliding_window, layer_scale, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.inv_freq, _ = rope_inv_freq(config)       # CPU (the model is built on the meta device)
        self._device_inv_freq: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        cos, sin = rotary_cos_sin(self._inv_freq_on(x.device), positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        if cache is not None:
            cache.length = start + x.shape[1]
        return self.norm(x)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The table on the inputs' device, copied once: a CUDA graph capture cannot copy from the host."""
        if self._device_inv_freq is None or self._device_inv_freq.device != device:
            self._device_inv_freq = self.inv_freq.to(device)
        return self._device_inv_freq
