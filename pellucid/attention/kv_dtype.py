"""The KV cache's element type: the model's dtype, or 8-bit floats (vLLM's `--kv-cache-dtype fp8`).

An FP8 cache holds twice the tokens in the same memory and halves the bytes decode attention reads. Keys and
values are stored unscaled (vLLM's default scale of 1.0), rounded to nearest and saturated at the format's
largest finite value (448 for e4m3, 57344 for e5m2), and read back exactly, so attention runs on the rounded
values in the model's dtype. Every backend and kernel that writes the cache rounds the same way.
"""
from __future__ import annotations

import torch

from pellucid.config import check_kv_cache_dtype

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype (CacheConfig.kv_cache_dtype): "auto" is the model's."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else _FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: cast to `dtype`, saturating for an FP8 cache (the kernels' rounding)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    largest = torch.finfo(dtype).max
    return x.float().clamp(-largest, largest).to(dtype)
