"""The triton backend's decode kernel with Qwen3's q/k norm + rotary inside (pellucid.attention.norm_rotary)
against the torch code: q_norm / k_norm / rotary in torch, write_kv, then the backend's plain forward.

Random decode batches with CUDA-graph padding, several split counts and KV tiles small enough that a
request's newest position lies in a later tile of its split (read back from the cache the kernel just
wrote). On the GPU the compiled kernels; on the CPU the same cases under the Triton interpreter (in a
subprocess, since TRITON_INTERPRET must be set before triton is imported).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if __name__ == "__main__":     # run as a script (under the interpreter): make `tests` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.attention.test_triton_backend import make_case  # noqa: E402
from tests.gpu.check_support import interpreted_checks, interpreter_runs_loaded_loop_bounds  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
# ||out - ref|| / ||ref||: the kernel's norm sums in another order and uses the hardware rsqrt, so a few
# bf16 roundings of q and k differ from torch's by one unit.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    from pellucid.models.layers import apply_rotary
    return apply_rotary(x, cos_sin[0].index_select(0, positions), cos_sin[1].index_select(0, positions))


def check_decode_case(seed: int, computed: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: str, block_n: int, min_tokens_per_split: int) -> None:
    from pellucid.attention.norm_rotary import QKNormRotary
    from pellucid.attention.triton_backend import TritonAttentionBackend

    case = make_case(seed, [1] * len(computed), computed, 16, heads, kv_heads, head_dim, dtype, device,
                     num_padded_reqs=1, num_pad_rows=2)
    gen = torch.Generator().manual_seed(seed + 7)
    rows = case.query.shape[0]
    # q, k and v as strided views of one projection output, as the decoder layer hands them over.
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype).to(device)
    query, key, value = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    query = query.view(rows, heads, head_dim)
    key = key.view(rows, kv_heads, head_dim)
    value = value.view(rows, kv_heads, head_dim)
    q_weight, k_weight = ((1 + torch.randn(head_dim, generator=gen) / 4).to(dtype).to(device) for _ in range(2))
    positions = torch.zeros(rows, dtype=torch.int64)
    positions[:len(computed)] = torch.tensor(computed)
    positions = positions.to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max(computed) + 8).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_sin = torch.stack((emb.cos(), emb.sin())).to(device)

    backend = TritonAttentionBackend(heads, kv_heads, head_dim, dtype, torch.device(device))
    backend.decode_block_n_small_batch = backend.decode_block_n_large_batch = block_n
    backend.decode_min_tokens_per_split = min_tokens_per_split
    metadata = backend.build_metadata(case.common)
    assert backend.fuses_qk_norm_rotary(metadata)
    what = f"seed={seed} {dtype} splits={metadata.num_splits} block_n={block_n}"

    # The torch code: norms, rotary, the KV write, attention.
    ref_q = _rotate(_rms_norm(query, q_weight, 1e-6), cos_sin, positions)
    ref_k = _rotate(_rms_norm(key, k_weight, 1e-5), cos_sin, positions)
    ref_cache = case.kv_cache.clone()
    backend.write_kv(ref_k, value, ref_cache, case.common.slot_mapping)
    expected = backend.forward(ref_q.contiguous(), ref_cache, metadata, case.scale)

    cache = case.kv_cache.clone()
    norm_rotary = QKNormRotary(key, value, q_weight, k_weight, 1e-6, 1e-5, cos_sin, positions)
    out = backend.forward_qk_norm_rotary(query, cache, metadata, case.scale, norm_rotary)

    real_rows = len(computed)
    assert torch.equal(out[real_rows:].cpu(), torch.zeros_like(out[real_rows:].cpu())), f"{what}: padding rows"
    err = (out[:real_rows].double() - expected[:real_rows].double()).norm() / expected[:real_rows].double().norm()
    assert err < REL_TOL[dtype], f"{what}: output relative error {err:.3g}"
    # The cache: equal to the torch write everywhere but the new keys (a rounding apart at most), and the
    # padded request (slot -1) wrote nothing.
    new_slots = case.common.slot_mapping[:real_rows].cpu()
    flat, ref_flat = cache.cpu().flatten(1, 2), ref_cache.cpu().flatten(1, 2)
    assert torch.equal(flat[1], ref_flat[1]), f"{what}: values in the cache"
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[new_slots] = False
    assert torch.equal(flat[0][untouched], ref_flat[0][untouched]), f"{what}: keys outside the new slots"
    k_err = (flat[0][new_slots].double() - ref_flat[0][new_slots].double()).norm() / ref_flat[0][new_slots].double().norm()
    assert k_err < REL_TOL[dtype], f"{what}: new keys relative error {k_err:.3g}"


def run_cases(device: str) -> None:
    on_cpu = device == "cpu"
    dtypes = (torch.float32, torch.float16) if on_cpu else (torch.float32, torch.bfloat16)
    shapes = [(4, 2, 32), (6, 3, 64)] if on_cpu else [(32, 4, 128), (16, 8, 64), (14, 2, 128)]
    for seed in range(1 if on_cpu else 2):
        gen = torch.Generator().manual_seed(seed)
        for heads, kv_heads, head_dim in shapes:
            for dtype in dtypes:
                computed = torch.randint(0, 150 if on_cpu else 3000, (3,), generator=gen).tolist()
                # (KV tile, shortest split): one split of many tiles, several splits, the default tiles.
                for block_n, min_split in ((16, 4096), (16, 24), (64 if on_cpu else 128, 128)):
                    check_decode_case(seed, computed, heads, kv_heads, head_dim, dtype, device, block_n, min_split)
    print("norm rotary cases passed")


@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device and triton")
@pytest.mark.gpu
def test_decode_norm_rotary_on_gpu() -> None:
    run_cases("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_decode_norm_rotary_under_interpreter() -> None:
    interpreted_checks(__file__, "norm rotary cases passed")


if __name__ == "__main__" and "--interpret" in sys.argv:
    torch.set_num_threads(1)
    if interpreter_runs_loaded_loop_bounds():
        run_cases("cpu")
