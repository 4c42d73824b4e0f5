"""Small dense transformer layers on [batch, time, hidden] inputs, for the parts of Qwen3-Omni that are no
paged-KV LLM: the talker's code predictor (a few positions per frame, its own short KV cache) and
code2wav's pre-transformer (a window of frames, sliding-window attention, recomputed per window).

Module names are transformers' (self_attn.q_proj, mlp.gate_proj, input_layernorm, ...); the math is its
eager attention's in float32 (softmax over scaled scores plus the mask), via torch's SDPA.

The code predictor runs 15 passes of its layers per frame, one position each, so on the GPU it is bound by
kernel count, not bytes (BENCHMARKS.md, issue 20). Hence the layers use the engine's fused paths: one GEMM
for q/k/v (`MergedLinear`), q/k norm and rotary in one in-place kernel over a cached cos/sin table that
also stores the keys and values in the KV cache (laid out as the engine's paged cache), each
residual add fused with the RMSNorm after it, grouped-query attention without repeating keys, and masks
and positions made once per shape, not per call; 2-D [tokens, hidden] activations throughout, so
decode-sized products take the skinny GEMMs. On the CPU each of these is the plain torch code.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pellucid.attention.fused_kv_store import FusedKVStore
from pellucid.kernels import fused_kernels_enabled
from pellucid.models.layers import (GatedMLP, Linear, MergedLinear, RMSNorm, RotaryEmbedding, add_rms_norm,
                                    is_observed, merged_projections_enabled, qk_norm_rotary)


# Shapes whose positions and masks a stack keeps (a code predictor's graphs need ~16 per row count).
MAX_CACHED_SHAPES = 1024


class KVCache:
    """Per-layer keys and values of a short sequence, filled left to right: [2, B, T_max, kv_heads, D] per
    layer, the engine's paged cache layout with one block per row, so the kernel that finishes the keys
    (q/k norm + rotary) stores them and the values on the way (pellucid.attention.fused_kv_store)."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (2, batch, max_len, num_kv_heads, head_dim)
        self.layers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0     # positions stored (every layer advances together; see DenseStack.forward)


@dataclass(frozen=True)
class DenseStep:
    """What every layer of one DenseStack forward shares: the shape, the positions, the attention mask."""

    batch: int
    length: int                         # positions fed in this forward (per row)
    start: int                          # positions already in the cache
    positions: torch.Tensor             # [batch * length] on the device, row-major
    slots: torch.Tensor | None          # [batch * length] the tokens' KVCache slots (row * max_len + position)
    rotary: RotaryEmbedding
    mask: torch.Tensor | None           # [length, start + length] bool, or None (is_causal, or no mask at all)
    is_causal: bool


class DenseAttention(nn.Module):
    """`self_attn`: q/k/v projections, optional per-head q/k RMSNorm (Qwen3), rotary, causal attention over
    the cache (within the stack's sliding window, if any: the step's mask), o_proj."""

    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias, **factory)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias, **factory)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory) if qk_norm else None
        self.qkv = MergedLinear([self.q_proj, self.k_proj, self.v_proj])

    def _apply(self, fn: Any, recurse: bool = True) -> "DenseAttention":
        # `to`, `to_empty`, ... give each parameter its own new tensor: merge q/k/v again.
        super()._apply(fn, recurse)
        self.qkv.merge()
        return self

    def forward(self, x: torch.Tensor, step: DenseStep, cache: KVCache | None) -> torch.Tensor:
        """x [batch * length, hidden] (row-major) -> [batch * length, hidden]."""
        b, t = step.batch, step.length
        if merged_projections_enabled() and not is_observed(self.q_proj, self.k_proj, self.v_proj):
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b * t, self.num_heads, self.head_dim)
        k = k.view(b * t, self.num_kv_heads, self.head_dim)
        v = v.view(b * t, self.num_kv_heads, self.head_dim)
        store = None
        norms = [m for m in (self.q_norm, self.k_norm) if m is not None]
        if cache is not None and step.slots is not None and fused_kernels_enabled(q, "rotary_kv_store") \
                and not is_observed(*norms):
            store = FusedKVStore(v, cache.layers[self.layer_idx], step.slots)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk_norm_rotary(step.positions, q, k, self.q_norm, self.k_norm, step.rotary, store)
        else:
            q, k = step.rotary(step.positions, q, k, kv_store=store)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            end = step.start + t
            layer = cache.layers[self.layer_idx]
            if store is None or not store.stored:
                layer[0, :, step.start:end] = k.view(b, t, self.num_kv_heads, self.head_dim)
                layer[1, :, step.start:end] = v.view(b, t, self.num_kv_heads, self.head_dim)
            k = layer[0, :, :end].transpose(1, 2)
            v = layer[1, :, :end].transpose(1, 2)
        else:
            k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=step.mask, is_causal=step.is_causal, scale=self.head_dim ** -0.5,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim))


def _add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, norm(residual + x)); with no residual yet, (x, norm(x)). One kernel on CUDA while the
    norm is not observed."""
    if residual is None:
        return x, norm(x)
    if is_observed(norm):
        total = residual + x
        return total, norm(total)
    return add_rms_norm(x, residual, norm)


class DenseDecoderLayer(nn.Module):
    """Pre-norm decoder layer; `layer_scale`: code2wav scales each branch's output by a learnt vector."""

    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, layer_scale: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = DenseAttention(config, layer_idx, qk_norm, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, **factory)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, **factory) if layer_scale else None
        self.mlp_layer_scale = LayerScale(config.hidden_size, **factory) if layer_scale else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: DenseStep, cache: KVCache | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP branch, the residual stream before it): the caller adds the two, fused with the
        next norm. x [tokens, hidden] is the previous layer's MLP branch (or the input, with residual None)."""
        residual, h = _add_norm(x, residual, self.input_layernorm)
        attn = self.self_attn(h, step, cache)
        if self.self_attn_layer_scale is not None:
            attn = self.self_attn_layer_scale(attn)
        residual, h = _add_norm(attn, residual, self.post_attention_layernorm)
        mlp = self.mlp(h)
        if self.mlp_layer_scale is not None:
            mlp = self.mlp_layer_scale(mlp)
        return mlp, residual


class LayerScale(nn.Module):
    def __init__(self, channels: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class DenseStack(nn.Module):
    """`layers` + `norm` + the rotary table: inputs_embeds [B, T, H] -> normed hidden [B, T, H].
    `max_positions`: the longest sequence it serves (the rotary table's length)."""

    def __init__(self, config: Any, qk_norm: bool, sliding_window: int | None, layer_scale: bool,
                 dtype: torch.dtype, device: torch.device | str, max_positions: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseDecoderLayer(config, i, qk_norm, layer_scale, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.sliding_window = sliding_window
        self.rotary = RotaryEmbedding(config, int(max_positions or config.max_position_embeddings), device)
        # (batch, length, start, cache length, device) -> its DenseStep: made once per shape, so a CUDA graph
        # replays no kernel for its positions, slots and mask and an eager call launches none; the least
        # recently used go first.
        self._steps: OrderedDict[tuple[Any, ...], DenseStep] = OrderedDict()

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, hidden = x.shape
        start = cache.length if cache is not None else 0
        if start + t > self.rotary.max_positions:
            raise ValueError(f"{start + t} positions exceed this stack's {self.rotary.max_positions} "
                             "(max_position_embeddings)")
        step = self._step(b, t, start, x.device, cache.max_len if cache is not None else None)
        out, residual = x.reshape(b * t, hidden), None
        for layer in self.layers:
            out, residual = layer(out, residual, step, cache)
        if cache is not None:
            cache.length = start + t
        return _add_norm(out, residual, self.norm)[1].view(b, t, hidden)

    def _step(self, b: int, t: int, start: int, device: torch.device, cache_len: int | None) -> DenseStep:
        key = (b, t, start, cache_len, str(device))
        step = self._steps.get(key)
        if step is None:
            positions = torch.arange(start, start + t, device=device).repeat(b)
            slots = None
            if cache_len is not None:   # row r's position p lives in slot r * cache_len + p
                slots = positions + torch.arange(b, device=device).repeat_interleave(t) * cache_len
            query = torch.arange(start, start + t, device=device)[:, None]
            keys = torch.arange(start + t, device=device)[None, :]
            windowed = self.sliding_window is not None and start + t > self.sliding_window
            if windowed:        # query i (position start + i) sees keys j in (start + i - window, start + i]
                assert self.sliding_window is not None
                mask, causal = (keys <= query) & (keys > query - self.sliding_window), False
            elif t == 1:        # one new position sees every cached one
                mask, causal = None, False
            elif start == 0:
                mask, causal = None, True
            else:
                mask, causal = keys <= query, False
            step = DenseStep(b, t, start, positions, slots, self.rotary, mask, causal)
            self._steps[key] = step
            if len(self._steps) > MAX_CACHED_SHAPES:
                self._steps.popitem(last=False)
        else:
            self._steps.move_to_end(key)
        return step
