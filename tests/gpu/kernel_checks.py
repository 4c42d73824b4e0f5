"""Checks of the fused kernels against the plain torch layer code, runnable on a GPU or, on the CPU,
under the Triton interpreter (TRITON_INTERPRET=1 must be set before triton is imported).

`python tests/gpu/kernel_checks.py DEVICE` runs every check and exits non-zero on the first mismatch.
"""
from __future__ import annotations

import sys

import torch

from pellucid.models import layers
from tests.gpu.check_support import assert_close, assert_kv_stored, make_kv_store


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_rms_norm(device: str, dtype: torch.dtype, seed: int) -> None:
    from pellucid.kernels.rms_norm import rms_norm
    g = torch.Generator().manual_seed(seed)
    for shape in [(7, 64), (3, 4, 16), (5, 96)]:
        x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
        assert_close(rms_norm(x, w, 1e-6), _reference_rms_norm(x, w, 1e-6), dtype, f"rms_norm {shape} {dtype}")


def check_silu_and_mul(device: str, dtype: torch.dtype, seed: int) -> None:
    from pellucid.kernels.silu_and_mul import silu_and_mul
    g = torch.Generator().manual_seed(seed)
    # Batched [B, S, I] inputs too: Qwen3-Omni's code predictor calls the shared MLP with them.
    for shape in [(5, 128), (3, 300), (2, 3, 64)]:
        gate = (torch.randn(shape, generator=g) * 2).to(dtype).to(device)
        up = torch.randn(shape, generator=g).to(dtype).to(device)
        ref = torch.nn.functional.silu(gate) * up
        assert_close(silu_and_mul(gate, up), ref, dtype, f"silu_and_mul {shape} {dtype}")


def check_rotary(device: str, dtype: torch.dtype, seed: int) -> None:
    from transformers import LlamaConfig

    from pellucid.kernels.rotary import rotary_inplace
    g = torch.Generator().manual_seed(seed)
    for heads, kv_heads, head_dim in [(4, 2, 16), (6, 2, 32)]:
        config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, max_position_embeddings=256, rope_theta=10000.0)
        rope = layers.RotaryEmbedding(config, 256, device)
        num_tokens = 9
        positions = torch.randint(0, 256, (num_tokens,), generator=g).to(device)
        q = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype).to(device)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype).to(device)
        cos = rope.cos_sin_cache[0].index_select(0, positions)
        sin = rope.cos_sin_cache[1].index_select(0, positions)
        ref_q, ref_k = layers.apply_rotary(q, cos, sin), layers.apply_rotary(k, cos, sin)
        q_again, k_again = q.clone(), k.clone()
        rotary_inplace(positions, q, k, rope.cos_sin_cache)
        assert_close(q, ref_q, dtype, f"rotary q {heads}/{kv_heads}x{head_dim} {dtype}")
        assert_close(k, ref_k, dtype, f"rotary k {heads}/{kv_heads}x{head_dim} {dtype}")
        # The same rotation storing the keys and values into a paged cache on the way.
        store, cache_before = make_kv_store(num_tokens, kv_heads, head_dim, dtype, device, g)
        rotary_inplace(positions, q_again, k_again, rope.cos_sin_cache, store)
        assert torch.equal(q_again, q) and torch.equal(k_again, k), "rotary with a KV store rotated differently"
        assert_kv_stored(store, cache_before, k, f"rotary KV store {heads}/{kv_heads}x{head_dim} {dtype}")


def check_snake_beta(device: str, dtype: torch.dtype, seed: int) -> None:
    from pellucid.kernels.snake_beta import snake_beta
    from pellucid.models.qwen3_omni.code2wav import SnakeBeta
    g = torch.Generator().manual_seed(seed)
    # A strided input too: code2wav trims its transposed convolutions' outputs along L.
    for shape, trim in [((2, 5, 300), 0), ((1, 3, 2100), 7), ((3, 16, 33), 2)]:
        module = SnakeBeta(shape[1], dtype=dtype, device="cpu")
        with torch.no_grad():
            module.alpha.copy_(0.5 * torch.randn(shape[1], generator=g))
            module.beta.copy_(0.5 * torch.randn(shape[1], generator=g))
        module = module.to(device)
        full = (torch.randn(shape[0], shape[1], shape[2] + 2 * trim, generator=g) * 4).to(dtype).to(device)
        x = full[..., trim:full.shape[-1] - trim]
        with torch.no_grad():     # the module's torch code, on any device
            alpha = torch.exp(module.alpha)[None, :, None]
            beta = torch.exp(module.beta)[None, :, None]
            ref = x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)
            assert_close(snake_beta(x, module.alpha, module.beta), ref, dtype, f"snake_beta {shape} trim {trim} {dtype}")


def check_top_k_race(device: str, dtype: torch.dtype, seed: int) -> None:
    """The one-launch draw equals the code predictor's torch draw (top_k_top_p_race, which equals the
    sampler's) and torch.argmax for greedy rows, on random logits with some exact ties."""
    from pellucid.kernels.top_k_race import top_k_race
    from pellucid.models.qwen3_omni.code_predictor import _TOP_P_FLOOR, TOP_K, top_k_top_p_race
    g = torch.Generator().manual_seed(seed)
    # The code predictor's 2,048-entry vocabulary on the GPU; the interpreter sorts far slower (minutes).
    shapes = [(6, 2048, 3.0), (5, 300, 1.0), (3, 40, 2.0)] if device != "cpu" else [(4, 160, 3.0), (3, 40, 2.0)]
    for rows, vocab, scale in shapes:
        logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
        logits[0, :7] = logits[0].max()         # a tie at the top: argmax takes the first
        noise = torch.empty(rows, vocab).exponential_(generator=g)
        greedy = torch.rand(rows, generator=g) < 0.3
        greedy[0] = True
        want = torch.where(greedy, logits.float().argmax(dim=-1), top_k_top_p_race(logits.float(), noise))
        got = top_k_race(logits.to(device), noise.to(device), greedy.to(device), TOP_K, _TOP_P_FLOOR)
        assert torch.equal(got.cpu(), want), f"top_k_race {rows}x{vocab} {dtype}: {got.tolist()} != {want.tolist()}"
        argmax = top_k_race(logits.to(device), None, None, TOP_K, _TOP_P_FLOOR)
        assert torch.equal(argmax.cpu(), logits.float().argmax(dim=-1)), f"top_k_race greedy {rows}x{vocab} {dtype}"


def run_all(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(3):
            check_rms_norm(device, dtype, seed)
            check_silu_and_mul(device, dtype, seed)
            check_rotary(device, dtype, seed)
            check_snake_beta(device, dtype, seed)
        check_top_k_race(device, dtype, 0)     # its sort is slow under the interpreter: one seed per dtype


if __name__ == "__main__":
    run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("kernel checks passed")
