"""The attention layer's side of the fused KV store: it offers a store only to backends whose KV write is
the plain slot store, and writes the cache itself unless a kernel marked the store done."""
from __future__ import annotations

import torch

from pellucid.attention.backend import get_backend_class
from pellucid.attention.fused_kv_store import FusedKVStore
from pellucid.attention.layer import Attention
from pellucid.attention.metadata import ForwardContext, forward_context


class _CountingBackend:
    def __init__(self, plain: bool) -> None:
        self.kv_write_is_plain_store = plain
        self.writes = 0

    def write_kv(self, key, value, kv_cache, slot_mapping, kv_scales) -> None:
        self.writes += 1

    def forward(self, query, kv_cache, metadata, scale, kv_scales) -> torch.Tensor:
        return torch.zeros_like(query)


class _Metadata:
    slot_mapping = torch.tensor([3, -1])


def _run(backend: _CountingBackend, stored: bool | None) -> tuple[FusedKVStore | None, int]:
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=0, scale=0.3)
    cache = torch.zeros(2, 2, 4, 2, 8)
    ctx = ForwardContext(attn_metadata=_Metadata(), backend=backend, backend_metadata=None, kv_caches=[cache],
                         positions=torch.zeros(2, dtype=torch.long), token_to_req=torch.zeros(2, dtype=torch.int32))
    q, k, v = torch.randn(2, 32), torch.randn(2, 16), torch.randn(2, 16)
    with forward_context(ctx):
        store = attn.fused_kv_store(v)
        if store is not None and stored is not None:
            store.stored = stored
        attn(q, k, v, kv_store=store)
    return store, backend.writes


def test_store_offered_only_for_plain_kv_writes():
    store, writes = _run(_CountingBackend(plain=False), stored=None)
    assert store is None and writes == 1
    store, _ = _run(_CountingBackend(plain=True), stored=None)
    assert store is not None and store.value.shape == (2, 2, 8) and torch.equal(store.slot_mapping, _Metadata.slot_mapping)


def test_write_kv_skipped_only_when_a_kernel_stored():
    assert _run(_CountingBackend(plain=True), stored=True)[1] == 0
    assert _run(_CountingBackend(plain=True), stored=False)[1] == 1


def test_builtin_backends_declare_their_kv_write():
    assert get_backend_class("torch").kv_write_is_plain_store is False
    try:
        triton_backend = get_backend_class("triton")
    except ValueError:      # triton not installed
        return
    assert triton_backend.kv_write_is_plain_store is True
