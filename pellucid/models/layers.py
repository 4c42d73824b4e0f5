"""Layers shared by the decoder models: RMSNorm, rotary embedding, the gated SiLU MLP.

Plain torch with HuggingFace-equivalent numerics. On CUDA (pellucid.kernels.fused_kernels_enabled)
`rms_norm`, `RotaryEmbedding.forward` and `GatedMLP.forward` run fused Triton kernels that round at
the same points; the CPU always runs the torch code.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pellucid.kernels import fused_kernels_enabled

# Rope types whose frequencies do not depend on the sequence being processed. "dynamic" (NTK) and
# "longrope" switch frequencies with the batch's length, which has no per-request meaning in a
# continuous batch, so they are refused rather than approximated.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in float32, cast back to the input dtype, then scale."""
    if fused_kernels_enabled(x, "rms_norm"):
        from pellucid.kernels.rms_norm import rms_norm as fused_rms_norm
        return fused_rms_norm(x, weight, eps)
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


class GatedMLP(nn.Module):
    """down_proj(act_fn(gate_proj(x)) * up_proj(x)), the Llama/Qwen/Mistral MLP.

    `act_fn` is a module, as in HuggingFace, so `mlp.act_fn` is a traceable site; a fused
    silu-and-mul kernel must keep that site observable when it is traced.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The fused kernel skips the `act_fn` call, so it runs only while nothing observes that site.
        if fused_kernels_enabled(x, "silu_and_mul") and not _has_hooks(self.act_fn):
            from pellucid.kernels.silu_and_mul import silu_and_mul as fused_silu_and_mul
            return self.down_proj(fused_silu_and_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _has_hooks(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_impl
    return bool(module._forward_hooks or module._forward_pre_hooks or module_impl._global_forward_hooks
                or module_impl._global_forward_pre_hooks)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim] (the neox / HF "rotate_half" layout)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def rope_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32, CPU) and the cos/sin scaling, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = _head_dim(hf_config)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim))
        return inv_freq, 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(attention_scaling)


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position up to `max_positions`, indexed by absolute position.

    One instance is shared by all attention layers of a model. The table is a non-persistent float32
    buffer; `rebuild_buffers()` recomputes it after the model is materialised from the meta device.
    """

    def __init__(self, hf_config: Any, max_positions: int, device: torch.device | str) -> None:
        super().__init__()
        self.inv_freq_cpu, self.attention_scaling = rope_inv_freq(hf_config)
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", self._compute_cache(torch.device("cpu")).to(device), persistent=False)

    def _compute_cache(self, device: torch.device) -> torch.Tensor:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq_cpu.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling))

    def rebuild_buffers(self) -> None:
        self.cos_sin_cache = self._compute_cache(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, heads, head_dim] and key [T, kv_heads, head_dim] at positions [T].

        On CUDA the fused kernel rotates query and key in place (they are fresh projections that only
        this call consumes) and returns them.
        """
        if fused_kernels_enabled(query, "rotary") and query.stride(-1) == 1 and key.stride(-1) == 1:
            from pellucid.kernels.rotary import rotary_inplace
            rotary_inplace(positions, query, key, self.cos_sin_cache)
            return query, key
        cos = self.cos_sin_cache[0].index_select(0, positions)
        sin = self.cos_sin_cache[1].index_select(0, positions)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
