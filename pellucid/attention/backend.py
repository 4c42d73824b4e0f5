"""The attention backend interface and its registry. Models call backends only through this."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales
from pellucid.attention.metadata import CommonAttentionMetadata
from pellucid.attention.norm_rotary import QKNormRotary


class AttentionBackend(ABC):
    """One instance per model runner, shared by all attention layers (they have the same shapes).

    KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = keys, 1 = values), in
    `kv_cache_dtype`: the model's dtype, or an FP8 type whose values write_kv scales and rounds as
    pellucid.attention.kv_dtype.quantize_kv does and forward reads back times the same layer's scales
    (`kv_scales`, which only an FP8 cache applies).
    """

    name: str = ""
    # True when forward/write_kv read only device tensors and host sizes fixed by build_metadata, so a
    # decode step can be captured in a CUDA graph (pellucid/runner/cuda_graphs.py) and replayed.
    supports_cuda_graphs: bool = False
    # True when write_kv only stores each key/value row at its slot in the layout above (slot -1 skipped),
    # so a kernel that holds the final keys may store them itself (pellucid.attention.fused_kv_store).
    kv_write_is_plain_store: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype or dtype
        if self.kv_cache_dtype != dtype:
            # Storing into an FP8 cache rounds: no kernel that holds the final keys stores them in its place.
            self.kv_write_is_plain_store = False

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Derive backend-specific metadata once per step (from host buffers; never read the device)."""
        return common

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KvScales = UNIT_KV_SCALES) -> None:
        """Store the new tokens' keys/values ([T, kv_heads, head_dim]) at their slots; slot -1 is skipped."""

    @abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, scale: float,
                kv_scales: KvScales = UNIT_KV_SCALES) -> torch.Tensor:
        """Causal attention of query [T, heads, head_dim] over each request's cached prefix plus its
        own new tokens (already written by write_kv with the same `kv_scales`). Returns [T, heads, head_dim]."""

    def decode_graph_lengths(self, num_reqs: int, max_model_len: int) -> list[int]:
        """The longest-sequence lengths, ascending and ending at max_model_len, at which to capture the decode
        CUDA graphs of `num_reqs` requests (pellucid/runner/cuda_graphs.py): a replayed step whose longest
        sequence has L tokens runs the graph of the first length >= L, whose metadata was built with that
        length as max_seq_len. A backend whose decode launch shape follows the length offers several; by
        default one graph per batch size serves every length."""
        return [max_model_len]

    def fuses_qk_norm_rotary(self, metadata: Any) -> bool:
        """True when `forward_qk_norm_rotary` can run the step `metadata` describes."""
        return False

    def forward_qk_norm_rotary(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, scale: float,
                               norm_rotary: QKNormRotary) -> torch.Tensor:
        """`forward` for a raw query [T, heads, head_dim], after applying Qwen3's q/k norm + rotary to it and to
        norm_rotary.key, whose keys it also writes to the cache with norm_rotary.value
        (pellucid.attention.norm_rotary). Only where `fuses_qk_norm_rotary(metadata)`."""
        raise NotImplementedError(f"attention backend {self.name!r} does not apply q/k norm + rotary itself")


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls
    return wrap


_UNAVAILABLE: dict[str, str] = {}   # backend name -> why it could not be imported here


def get_backend_class(name: str) -> type[AttentionBackend]:
    _import_builtin_backends()
    if name in _UNAVAILABLE:
        raise ValueError(f"attention backend {name!r} is not available here: {_UNAVAILABLE[name]}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]


def available_backends() -> list[str]:
    _import_builtin_backends()
    return sorted(_BACKENDS)


def _import_builtin_backends() -> None:
    import pellucid.attention.torch_ref  # noqa: F401
    if "triton" in _BACKENDS or "triton" in _UNAVAILABLE:
        return
    try:
        import pellucid.attention.triton_backend  # noqa: F401
    except ImportError as exc:  # triton is an optional dependency (the `gpu` extra)
        _UNAVAILABLE["triton"] = f"{type(exc).__name__}: {exc} (install the `gpu` extra: pip install triton)"
