"""The torch reference backend against dense causal attention computed per request from the full K/V."""
from __future__ import annotations

import random

import pytest
import torch

from pellucid.attention.backend import get_backend_class
from pellucid.attention.torch_ref import TorchReferenceBackend
from tests.models.helpers import build_attention_metadata


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int,
                     scale: float) -> torch.Tensor:
    """q [Q, H, D] at positions first_position.., k/v [S, KV, D] for positions 0..S-1 -> [Q, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    q = q.float().transpose(0, 1)
    allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(diagonal=first_position)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def _allocate_blocks(rng: random.Random, seq_lens: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]


CASES = [
    # (num_computed, num_scheduled): prefill from zero, chunk on a prefix, decode, all mixed
    ([0, 0, 0], [5, 17, 1]),
    ([12, 40, 3], [1, 1, 1]),
    ([0, 16, 33, 7], [9, 20, 1, 1]),
    ([31, 0], [2, 64]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_dense_causal_attention(dtype: torch.dtype, heads: int, kv_heads: int, block_size: int) -> None:
    head_dim, scale = 16, 0.3
    backend = TorchReferenceBackend(heads, kv_heads, head_dim, dtype, torch.device("cpu"))
    for seed, (computed, scheduled) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        seq_lens = [c + s for c, s in zip(computed, scheduled)]
        tables = _allocate_blocks(rng, seq_lens, block_size, num_blocks=24)
        cache = torch.randn(2, 24, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        keys = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        values = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        queries = [torch.randn(s, heads, head_dim, generator=gen).to(dtype) for s in scheduled]

        # An earlier step wrote the cached prefixes (requests without a prefix schedule nothing then).
        prefix, _, _ = build_attention_metadata([0] * len(computed), computed, tables, block_size)
        backend.write_kv(torch.cat([k[:c] for k, c in zip(keys, computed)]),
                         torch.cat([v[:c] for v, c in zip(values, computed)]), cache, prefix.slot_mapping)

        num_tokens = sum(scheduled)
        metadata, _, _ = build_attention_metadata(computed, scheduled, tables, block_size,
                                                  num_padded_tokens=num_tokens + 3)
        pad = torch.randn(3, kv_heads, head_dim, generator=gen).to(dtype)
        new_keys = torch.cat([k[c:] for k, c in zip(keys, computed)] + [pad])
        new_values = torch.cat([v[c:] for v, c in zip(values, computed)] + [pad])
        query = torch.cat(queries + [torch.randn(3, heads, head_dim, generator=gen).to(dtype)])
        backend.write_kv(new_keys, new_values, cache, metadata.slot_mapping)
        out = backend.forward(query, cache, backend.build_metadata(metadata), scale)

        assert out.shape == query.shape and out.dtype == dtype
        assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))
        starts = metadata.query_start_loc_cpu.tolist()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for r in range(len(scheduled)):
            expected = _dense_reference(queries[r], keys[r], values[r], computed[r], scale)
            torch.testing.assert_close(out[starts[r]:starts[r + 1]].float(), expected.to(dtype).float(),
                                       atol=tol, rtol=tol)


def test_write_kv_places_tokens_at_slots_and_skips_negative() -> None:
    backend = get_backend_class("torch")(4, 2, 8, torch.float32, torch.device("cpu"))
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        cache = torch.randn(2, 6, 4, 2, 8, generator=gen)
        before = cache.clone()
        slots = torch.randperm(24, generator=gen)[:7]
        slots[torch.randint(0, 7, (2,), generator=gen)] = -1
        key = torch.randn(7, 2, 8, generator=gen)
        value = torch.randn(7, 2, 8, generator=gen)
        backend.write_kv(key, value, cache, slots)
        expected = before.view(2, 24, 2, 8).clone()
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                expected[0, slot], expected[1, slot] = key[i], value[i]
        assert torch.equal(cache.view(2, 24, 2, 8), expected)


def test_inconsistent_metadata_is_rejected() -> None:
    backend = TorchReferenceBackend(2, 1, 8, torch.float32, torch.device("cpu"))
    metadata, _, _ = build_attention_metadata([3], [2], [[0]], 16)
    metadata.seq_lens_cpu[0] = 4
    with pytest.raises(ValueError, match="seq_len"):
        backend.forward(torch.randn(2, 2, 8), torch.zeros(2, 1, 16, 1, 8), metadata, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_cpu() -> None:
    torch.manual_seed(0)
    computed, scheduled, block_size = [0, 20, 9], [13, 1, 30], 16
    tables = [[0], [1, 2], [3, 4, 5]]
    cache = torch.randn(2, 8, block_size, 2, 16)
    query = torch.randn(sum(scheduled), 4, 16)
    results = []
    for device in ("cpu", "cuda"):
        backend = TorchReferenceBackend(4, 2, 16, torch.float32, torch.device(device))
        metadata, _, _ = build_attention_metadata(computed, scheduled, tables, block_size, device=device)
        results.append(backend.forward(query.to(device), cache.to(device), metadata, 0.25).cpu())
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
