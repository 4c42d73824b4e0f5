"""Triton kernels of the "triton" attention backend: KV store, split-KV decode, unified prefill/mixed."""
from pellucid.attention.triton_kernels.decode import decode_attention
from pellucid.attention.triton_kernels.kv_write import write_kv
from pellucid.attention.triton_kernels.unified import unified_attention

__all__ = ["decode_attention", "unified_attention", "write_kv"]
