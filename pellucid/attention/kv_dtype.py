"""The KV cache's element type: the model's dtype, or 8-bit floats (vLLM's `--kv-cache-dtype fp8`).

An FP8 cache holds twice the tokens in the same memory and halves the bytes decode attention reads. A layer's keys
are stored as key * (1 / k_scale), rounded to nearest and saturated at the format's largest finite value (448 for
e4m3, 57344 for e5m2), and read back as the stored value times k_scale; values likewise with v_scale. The scales
are the checkpoint's calibrated ones where it has them (`KvScales`, pellucid.models.kv_cache_scales), else 1.0
(vLLM's default). Every backend and kernel that writes the cache rounds the same way. A cache in the model's
dtype stores keys and values as they are, and the scales do not apply.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pellucid.config import check_kv_cache_dtype

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype (CacheConfig.kv_cache_dtype): "auto" is the model's."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else _FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KvScales:
    """One layer's KV-cache scales (per tensor): an FP8 cache stores keys divided by `k` and values by `v`."""
    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        for name, scale in (("k", self.k), ("v", self.v)):
            if not (scale > 0 and scale < float("inf")):
                raise ValueError(f"a KV-cache scale must be positive and finite, got {name}_scale={scale}")


UNIT_KV_SCALES = KvScales()


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as the cache stores it: for an FP8 cache x * (1 / scale) in float32, saturated and rounded (the kernels'
    rounding); else cast to `dtype` (the scale does not apply)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    largest = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-largest, largest).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """float32 values of cache entries: an FP8 entry times its scale; any other as it is."""
    return stored.float() * scale if is_fp8(stored.dtype) else stored.float()
