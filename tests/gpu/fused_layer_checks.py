"""Checks of the add + RMSNorm and q/k norm + rotary kernels against the plain torch layer code, on a GPU
or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported).

`python tests/gpu/fused_layer_checks.py DEVICE` runs every check and exits non-zero on the first mismatch.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from pellucid.models import layers
from tests.gpu.check_support import assert_close, assert_kv_stored, make_kv_store


def check_add_rms_norm(device: str, dtype: torch.dtype, seed: int) -> None:
    from pellucid.kernels.add_rms_norm import add_rms_norm
    g = torch.Generator().manual_seed(seed)
    for rows, hidden in [(7, 64), (1, 96), (5, 1024)]:
        x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
        residual = (torch.randn(rows, hidden, generator=g) * 5).to(dtype).to(device)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
        total, normed = add_rms_norm(x, residual, w, 1e-6)
        ref_total = residual + x
        if os.environ.get("TRITON_INTERPRET") == "1":    # the interpreter truncates bf16 instead of rounding
            assert_close(total, ref_total, dtype, f"add_rms_norm sum {rows}x{hidden} {dtype}")
        else:                                            # one rounding of one sum, as torch's add: exact
            torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
        assert_close(normed, w * _normalise(ref_total, 1e-6), dtype, f"add_rms_norm {rows}x{hidden} {dtype}")


def check_add_top_k_rms_norm(device: str, dtype: torch.dtype, seed: int) -> None:
    """Each token's top_k rows summed (float32, in row order, rounded once: moe_gemm.sum_top_k's rounding), then
    the residual add + norm; against torch."""
    from pellucid.kernels.add_rms_norm import add_rms_norm, add_top_k_rms_norm
    from pellucid.kernels.moe_gemm import sum_top_k
    g = torch.Generator().manual_seed(seed)
    for tokens, top_k, hidden in [(1, 8, 2048), (5, 2, 64), (3, 3, 96)]:
        rows = (torch.randn(tokens * top_k, hidden, generator=g) * 2).to(dtype).to(device)
        residual = (torch.randn(tokens, hidden, generator=g) * 5).to(dtype).to(device)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
        total, normed = add_top_k_rms_norm(rows, top_k, residual, w, 1e-6)
        summed = rows.view(tokens, top_k, hidden).to(torch.float64).sum(1).to(dtype)
        what = f"add_top_k_rms_norm {tokens}x{top_k}x{hidden} {dtype}"
        assert_close(total, residual + summed, dtype, what + " sum")
        assert_close(normed, w * _normalise(residual + summed, 1e-6), dtype, what)
        if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter truncates bf16 instead of rounding
            # the MoE block's two launches (its top-k sum, then the add + norm as the layer calls it after an MoE
            # block) give the same bits
            total_2, normed_2 = add_rms_norm(sum_top_k(rows, tokens, top_k), residual, w, 1e-6, like_top_k=True)
            torch.testing.assert_close(total, total_2, rtol=0, atol=0)
            torch.testing.assert_close(normed, normed_2, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows"):
        add_top_k_rms_norm(rows[1:], top_k, residual, w, 1e-6)


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_qk_norm_rotary(device: str, dtype: torch.dtype, seed: int) -> None:
    from transformers import Qwen3Config

    from pellucid.kernels.qk_norm_rotary import qk_norm_rotary_inplace
    g = torch.Generator().manual_seed(seed)
    for heads, kv_heads, head_dim in [(4, 2, 16), (6, 2, 32), (16, 8, 128)]:
        config = Qwen3Config(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, max_position_embeddings=256, rope_theta=10000.0)
        rope = layers.RotaryEmbedding(config, 256, device)
        q_norm = layers.RMSNorm(head_dim, 1e-6, dtype, device)
        k_norm = layers.RMSNorm(head_dim, 1e-5, dtype, device)
        with torch.no_grad():
            q_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim, generator=g))
            k_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim, generator=g))
        num_tokens = 9
        positions = torch.randint(0, 256, (num_tokens,), generator=g).to(device)
        # Strided views into one qkv output, as the merged projection produces them.
        qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype).to(device)
        q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
        cos = rope.cos_sin_cache[0].index_select(0, positions)
        sin = rope.cos_sin_cache[1].index_select(0, positions)
        with torch.no_grad():
            ref_q = layers.apply_rotary(q_norm(q.clone()), cos, sin)
            ref_k = layers.apply_rotary(k_norm(k.clone()), cos, sin)
        v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
        qkv_again = qkv.clone()
        qk_norm_rotary_inplace(positions, q, k, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6, 1e-5,
                               rope.cos_sin_cache)
        assert_close(q, ref_q, dtype, f"qk_norm_rotary q {heads}/{kv_heads}x{head_dim} {dtype}")
        assert_close(k, ref_k, dtype, f"qk_norm_rotary k {heads}/{kv_heads}x{head_dim} {dtype}")
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before), "qk_norm_rotary wrote into v"
        # The same kernel storing the keys and the values (the v part of qkv) into a paged cache on the way.
        store, cache_before = make_kv_store(num_tokens, kv_heads, head_dim, dtype, device, g)
        store.value = qkv_again[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
        q_again = qkv_again[:, :heads * head_dim].view(num_tokens, heads, head_dim)
        k_again = qkv_again[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
        qk_norm_rotary_inplace(positions, q_again, k_again, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6,
                               1e-5, rope.cos_sin_cache, store)
        assert torch.equal(qkv_again, qkv), "qk_norm_rotary with a KV store computed differently"
        assert_kv_stored(store, cache_before, k, f"qk_norm_rotary KV store {heads}/{kv_heads}x{head_dim} {dtype}")


def run_all(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(3):
            check_add_rms_norm(device, dtype, seed)
            check_add_top_k_rms_norm(device, dtype, seed)
            check_qk_norm_rotary(device, dtype, seed)


if __name__ == "__main__":
    run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("fused layer kernel checks passed")
