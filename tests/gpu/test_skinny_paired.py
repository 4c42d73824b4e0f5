"""Paired-row skinny GEMMs (pellucid.kernels.skinny_paired): q/k/v projection + rotary + KV store, and gate/up
projection + SiLU-and-mul, in one kernel each. Checked against the unfused kernels they replace and
against fp32 torch code, with a brute-force KV-cache check; on the GPU, and on the CPU under the Triton
interpreter (small shapes). Not bit for bit: the compiler may lay out (and so sum) the product
differently once an epilogue follows it.

`python tests/gpu/test_skinny_paired.py DEVICE` runs the checks and exits non-zero on a mismatch.
"""
from __future__ import annotations

import sys

import pytest
import torch

if __name__ == "__main__":     # run as a script (under the interpreter): make `tests` importable
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu.check_support import assert_close, run_script_under_interpreter, triton_importable

# (q heads, kv heads, head_dim, hidden) : Llama-3.1-8B and Llama-3.2-1B attention on the GPU; small ones anywhere.
QKV_SHAPES_GPU = [(32, 8, 128, 4096), (32, 8, 64, 2048), (4, 2, 32, 512)]
QKV_SHAPES_CPU = [(4, 2, 32, 256), (2, 1, 16, 96)]
GATE_UP_SHAPES_GPU = [(28672, 4096), (16384, 2048), (6144, 1024), (200, 96)]   # [2I, K]
GATE_UP_SHAPES_CPU = [(192, 128), (40, 96)]


def _cos_sin(max_positions: int, head_dim: int, device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin())).to(device)


def _tiles(m: int, n: int, k: int):
    from pellucid.kernels.skinny_gemm import SkinnyConfig
    from pellucid.kernels.skinny_paired import paired_config
    block_m = 1 << (m - 1).bit_length()
    picked = paired_config(m, n, k)
    return [c for c in (picked, SkinnyConfig(block_m, 2, 64, 1, 1, False), SkinnyConfig(16, 32, 64, 4, 2, True))
            if c is not None]


def check_qkv_rotary(device: str, shapes, seed: int) -> None:
    from pellucid.attention.fused_kv_store import FusedKVStore
    from pellucid.kernels import skinny_gemm
    from pellucid.kernels.rotary import rotary_inplace
    from pellucid.kernels.skinny_paired import qkv_rotary_linear
    from pellucid.models.layers import apply_rotary
    from tests.gpu.check_support import assert_kv_stored, make_kv_store
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    for hq, hkv, d, hidden in shapes:
        n = (hq + 2 * hkv) * d
        cos_sin = _cos_sin(64, d, device)
        weight = (torch.randn(n, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
        bias = torch.randn(n, generator=g).to(dtype).to(device)
        for m in (1, 2):
            x = torch.randn(m, hidden, generator=g).to(dtype).to(device)
            positions = torch.randint(0, 64, (m,), generator=g).to(device)
            for i, config in enumerate(_tiles(m, n, hidden)):
                if (hq + hkv) * d % config.block_n:
                    continue
                for b in (None, bias) if device == "cuda" else ((None, bias)[(i + m) % 2],):
                    what = f"qkv rotary M={m} heads {hq}/{hkv}x{d} K={hidden} bias={b is not None} {config}"
                    # The unfused kernels it replaces: the same GEMM tile, then the rotary + KV-store kernel.
                    store, cache_before = make_kv_store(m + 2, hkv, d, dtype, device, g)
                    slots = store.slot_mapping[:m]
                    unfused = skinny_gemm.linear(x, weight, b, config=config)
                    q, k, v = unfused.split([hq * d, hkv * d, hkv * d], dim=1)
                    q, k, v = q.view(m, hq, d), k.view(m, hkv, d), v.view(m, hkv, d)
                    reference_store = FusedKVStore(v, cache_before.clone(), slots)
                    rotary_inplace(positions, q, k, cos_sin, reference_store)
                    cache = cache_before.clone()
                    fused = qkv_rotary_linear(x, weight, b, positions, cos_sin, hq, hkv, d, cache, slots, config=config)
                    assert_close(fused, unfused, dtype, f"{what}: against projection + rotary kernels")
                    # Independent: fp32 torch projection, HF rotary, slot-by-slot store.
                    ref = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
                    rq, rk, rv = ref.split([hq * d, hkv * d, hkv * d], dim=1)
                    cos, sin = cos_sin[0][positions], cos_sin[1][positions]
                    rq, rk = apply_rotary(rq.reshape(m, hq, d), cos, sin), apply_rotary(rk.reshape(m, hkv, d), cos, sin)
                    assert_close(fused, torch.cat([rq.reshape(m, -1), rk.reshape(m, -1), rv], dim=1), dtype, what)
                    check = FusedKVStore(fused[:, n - hkv * d:].reshape(m, hkv, d), cache, slots, stored=True)
                    assert_kv_stored(check, cache_before, fused[:, hq * d:n - hkv * d].reshape(m, hkv, d), what)
                    # Without a cache: the same output, nothing stored.
                    plain = qkv_rotary_linear(x, weight, b, positions, cos_sin, hq, hkv, d, config=config)
                    assert torch.equal(plain, fused), f"{what}: output differs without the KV store"


def check_gate_up_silu(device: str, shapes, seed: int) -> None:
    from pellucid.kernels import skinny_gemm
    from pellucid.kernels.silu_and_mul import silu_and_mul
    from pellucid.kernels.skinny_paired import gate_up_silu_linear
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    for n, k in shapes:
        weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
        bias = torch.randn(n, generator=g).to(dtype).to(device)
        for m in (1, 2):
            x = (2 * torch.randn(m, k, generator=g)).to(dtype).to(device)
            for i, config in enumerate(_tiles(m, n, k)):
                for b in (None, bias) if device == "cuda" else ((None, bias)[(i + m) % 2],):
                    what = f"gate_up silu M={m} N={n} K={k} bias={b is not None} {config}"
                    fused = gate_up_silu_linear(x, weight, b, config=config)
                    gate, up = skinny_gemm.linear(x, weight, b, config=config).chunk(2, dim=1)
                    assert_close(fused, silu_and_mul(gate, up), dtype, f"{what}: against GEMM + silu_and_mul")
                    ref_gate, ref_up = torch.nn.functional.linear(
                        x.float(), weight.float(), None if b is None else b.float()).to(dtype).chunk(2, dim=1)
                    assert_close(fused, torch.nn.functional.silu(ref_gate) * ref_up, dtype, what)


def run_all(device: str) -> None:
    cpu = device == "cpu"     # the interpreter is slow: one seed and the small shapes there
    for seed in (0,) if cpu else (0, 1):
        check_qkv_rotary(device, QKV_SHAPES_CPU if cpu else QKV_SHAPES_GPU, seed)
        check_gate_up_silu(device, GATE_UP_SHAPES_CPU if cpu else GATE_UP_SHAPES_GPU, seed)


def test_refusals():
    from pellucid.kernels.skinny_paired import gate_up_silu_linear, qkv_rotary_config, qkv_rotary_linear
    x = torch.randn(1, 64)
    with pytest.raises(ValueError):
        gate_up_silu_linear(x, torch.randn(7, 64))                          # odd gate/up rows
    with pytest.raises(ValueError):
        qkv_rotary_linear(x, torch.randn(100, 64), None, torch.zeros(1, dtype=torch.long),
                          torch.zeros(2, 8, 16), 2, 1, 16)                  # 100 rows are not 4 heads of 16
    assert qkv_rotary_config(64, 4096, 32, 8, 128) is None                  # prefill-sized: unfused path


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernels (the *_on_gpu test)")
def test_skinny_paired_under_triton_interpreter():
    run_script_under_interpreter("test_skinny_paired.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_skinny_paired_on_gpu():
    run_all("cuda")


if __name__ == "__main__":
    run_all(sys.argv[1])
