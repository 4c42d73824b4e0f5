"""The "triton" attention backend against a brute-force float64 per-request reference.

GPU tests run the compiled kernels; without CUDA they skip. The CPU test runs a few small cases of
this same file under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported, so
in a subprocess), skipping when triton is not installed.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch

from pellucid.attention.metadata import CommonAttentionMetadata
from tests.gpu.check_support import interpreted_checks, interpreter_runs_loaded_loop_bounds

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device and triton")

# ||out - ref|| / ||ref|| bounds per dtype (float32 uses exact-precision dots)
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@dataclass
class Case:
    query: torch.Tensor          # [T_padded, H, D]
    key: torch.Tensor            # [T_padded, KVH, D] new tokens (padded rows are garbage and must not land)
    value: torch.Tensor
    kv_cache: torch.Tensor       # [2, N, B, KVH, D] with the cached prefixes already in place
    common: CommonAttentionMetadata
    q_lens: list[int]
    computed: list[int]
    num_real_reqs: int
    scale: float


def make_case(seed: int, q_lens: list[int], computed: list[int], block_size: int, num_heads: int,
              num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
              num_padded_reqs: int = 0, num_pad_rows: int = 0, num_blocks: int | None = None,
              max_blocks: int | None = None) -> Case:
    """Random requests with `computed[r]` tokens already cached and `q_lens[r]` new ones.

    Padded requests (CUDA-graph style) have one query row, seq_len 0 and slot -1; `num_pad_rows` more
    token rows at the end belong to no request. num_blocks/max_blocks fix the cache and block-table
    sizes (for CUDA-graph replays on fresh inputs).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(computed, q_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max_blocks or max(blocks_per_req + [1]) + 2
    num_blocks = num_blocks or sum(blocks_per_req) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    num_reqs = len(q_lens) + num_padded_reqs
    block_table = torch.randint(0, num_blocks, (num_reqs, max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n

    all_q_lens = q_lens + [1] * num_padded_reqs
    all_seq_lens = seq_lens + [0] * num_padded_reqs
    all_computed = computed + [0] * num_padded_reqs
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(all_q_lens), 0)
    num_rows = int(query_start_loc[-1]) + num_pad_rows
    slot_mapping = torch.full((num_rows,), -1, dtype=torch.int64)
    for r in range(len(q_lens)):
        for i in range(q_lens[r]):
            pos = computed[r] + i
            slot_mapping[int(query_start_loc[r]) + i] = int(block_table[r, pos // block_size]) * block_size + pos % block_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    query, key, value = (randn(num_rows, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    common = CommonAttentionMetadata(
        num_reqs=num_reqs, num_tokens=int(query_start_loc[len(q_lens)]), max_query_len=max(all_q_lens),
        max_seq_len=max(all_seq_lens), block_size=block_size,
        query_start_loc=query_start_loc.to(device), seq_lens=torch.tensor(all_seq_lens, dtype=torch.int32).to(device),
        num_computed_tokens=torch.tensor(all_computed, dtype=torch.int32).to(device),
        block_table=block_table.to(device), slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=torch.tensor(all_seq_lens, dtype=torch.int32),
        num_computed_tokens_cpu=torch.tensor(all_computed, dtype=torch.int32), block_table_cpu=block_table)
    return Case(query.to(device), key.to(device), value.to(device), kv_cache.to(device), common,
                q_lens, computed, len(q_lens), 1.0 / math.sqrt(head_dim) * (0.5 + torch.rand(1, generator=gen).item()))


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention per request, built from the cache *before* the write plus the new keys/values.

    Returns (expected output [T_padded, H, D], expected cache after write_kv).
    """
    cache = case.kv_cache.detach().cpu().double()
    expected_cache = case.kv_cache.detach().cpu().clone()
    block_table = case.common.block_table_cpu
    block_size = case.common.block_size
    q, k_new, v_new = (t.detach().cpu().double() for t in (case.query, case.key, case.value))
    num_heads, num_kv_heads = q.shape[1], k_new.shape[1]
    out = torch.zeros_like(q)
    starts = case.common.query_start_loc_cpu.tolist()
    for r in range(case.num_real_reqs):
        c, n = case.computed[r], case.q_lens[r]
        rows = slice(starts[r], starts[r] + n)
        keys, values = [], []
        for pos in range(c):
            block, offset = int(block_table[r, pos // block_size]), pos % block_size
            keys.append(cache[0, block, offset])
            values.append(cache[1, block, offset])
        for i in range(n):
            pos = c + i
            block, offset = int(block_table[r, pos // block_size]), pos % block_size
            expected_cache[0, block, offset] = case.key[starts[r] + i].cpu()
            expected_cache[1, block, offset] = case.value[starts[r] + i].cpu()
        k = torch.cat([torch.stack(keys)] + [k_new[rows]] if keys else [k_new[rows]], 0)
        v = torch.cat([torch.stack(values)] + [v_new[rows]] if values else [v_new[rows]], 0)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k) * case.scale
        visible = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, expected_cache


def run_backend(case: Case, backend_name: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    from pellucid.attention.backend import get_backend_class

    num_heads, head_dim = case.query.shape[1:]
    cls = get_backend_class(backend_name)
    backend = cls(num_heads, case.key.shape[1], head_dim, case.query.dtype, case.query.device)
    metadata = backend.build_metadata(case.common)
    kv_cache = case.kv_cache.clone()
    backend.write_kv(case.key, case.value, kv_cache, case.common.slot_mapping)
    out = backend.forward(case.query, kv_cache, metadata, case.scale)
    return out, kv_cache


def check_case(case: Case, backend_name: str = "triton") -> None:
    expected, expected_cache = reference(case)
    out, cache_after = run_backend(case, backend_name)
    out = out.cpu()
    assert torch.isfinite(out).all(), "NaN/inf in the attention output"
    # the cache changes exactly at the new tokens' slots, and padded rows (slot -1) wrote nothing
    assert torch.equal(cache_after.cpu(), expected_cache)
    real_rows = int(case.common.query_start_loc_cpu[case.num_real_reqs])
    assert torch.equal(out[real_rows:], torch.zeros_like(out[real_rows:])), "padding rows must come out as zeros"
    err = (out.double() - expected).norm() / expected.norm()
    assert err < REL_TOL[case.query.dtype], f"relative error {err:.3g} over {REL_TOL[case.query.dtype]}"


def random_lengths(seed: int, mixed: bool, block_size: int) -> tuple[list[int], list[int]]:
    """Ragged batches: decode rows with long prefixes; for mixed, also fresh prompts and chunks over a prefix."""
    gen = torch.Generator().manual_seed(1000 + seed)
    num_decode = int(torch.randint(1, 5, (1,), generator=gen))
    q_lens = [1] * num_decode
    computed = torch.randint(1, 700, (num_decode,), generator=gen).tolist()
    if mixed:
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            q_lens.append(int(torch.randint(2, 300, (1,), generator=gen)))
            computed.append(0)  # fresh prompt
        for _ in range(int(torch.randint(1, 3, (1,), generator=gen))):
            q_lens.append(int(torch.randint(2, 200, (1,), generator=gen)))
            computed.append(int(torch.randint(1, 400, (1,), generator=gen)) // block_size * block_size
                            + int(torch.randint(0, 2, (1,), generator=gen)) * 5)  # prefix hit or mid-block chunk
    order = torch.randperm(len(q_lens), generator=gen).tolist()
    return [q_lens[i] for i in order], [computed[i] for i in order]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_matches_reference_bf16(block_size: int, group: int, head_dim: int, mixed: bool) -> None:
    for seed in range(3):
        q_lens, computed = random_lengths(seed, mixed, block_size)
        case = make_case(seed, q_lens, computed, block_size, 2 * group, 2, head_dim, torch.bfloat16, "cuda",
                         num_padded_reqs=seed % 2, num_pad_rows=seed)
        check_case(case)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (4, 128, 32), (8, 128, 16)])
def test_triton_matches_reference_dtypes(group: int, head_dim: int, block_size: int, mixed: bool,
                                         dtype: torch.dtype) -> None:
    for seed in range(2):
        q_lens, computed = random_lengths(10 + seed, mixed, block_size)
        case = make_case(seed, q_lens, computed, block_size, 4 * group, 4, head_dim, dtype, "cuda", num_padded_reqs=1)
        check_case(case)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [1, 17, 300, 5000])
def test_triton_decode_split_counts(seq_len: int) -> None:
    """Every split count gives the same answer for one long-or-short sequence (Llama-3.1-8B head shape)."""
    from pellucid.attention.triton_kernels import decode_attention

    case = make_case(seq_len, [1], [seq_len - 1], 16, 32, 8, 128, torch.bfloat16, "cuda")
    expected, _ = reference(case)
    cache = case.kv_cache.clone()
    from pellucid.attention.triton_kernels import write_kv
    write_kv(case.key, case.value, cache, case.common.slot_mapping)
    for splits, block_n in ((1, 64), (2, 128), (7, 64), (32, 128)):
        out = torch.full_like(case.query, float("nan"))
        po = torch.full((1, 32, splits, 128), float("nan"), device="cuda")
        pl = torch.full((1, 32, splits), float("nan"), device="cuda")
        decode_attention(case.query, cache[0], cache[1], case.common.block_table, case.common.seq_lens,
                         case.common.query_start_loc, out, case.scale, splits, po, pl, block_n, 4, 2)
        err = (out.cpu().double() - expected).norm() / expected.norm()
        assert err < REL_TOL[torch.bfloat16], f"splits={splits}: relative error {err:.3g}"


@needs_gpu
@pytest.mark.gpu
def test_triton_decode_cuda_graph_replay() -> None:
    """Capture write_kv + forward for 5 decode requests (+2 padded), replay on fresh inputs."""
    from pellucid.attention.backend import get_backend_class

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    sizes = dict(num_padded_reqs=2, num_blocks=1400, max_blocks=260)
    backend = get_backend_class("triton")(heads, kv_heads, head_dim, torch.bfloat16, torch.device("cuda"))
    static = make_case(0, [1] * 5, [40, 700, 3, 1500, 64], block_size, heads, kv_heads, head_dim,
                       torch.bfloat16, "cuda", **sizes)
    # capture with the longest length the graph will serve, as a graph runner would
    capture_common = CommonAttentionMetadata(**{**static.common.__dict__, "max_seq_len": 4096})
    metadata = backend.build_metadata(capture_common)
    assert metadata.num_splits > 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            backend.write_kv(static.key, static.value, static.kv_cache.clone(), static.common.slot_mapping)
            backend.forward(static.query, static.kv_cache, metadata, static.scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.write_kv(static.key, static.value, static.kv_cache, static.common.slot_mapping)
        static_out = backend.forward(static.query, static.kv_cache, metadata, static.scale)

    for seed in range(1, 4):
        computed = torch.randint(1, 4000, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        fresh = make_case(seed, [1] * 5, computed, block_size, heads, kv_heads, head_dim, torch.bfloat16, "cuda",
                          **sizes)
        fresh.scale = static.scale
        for name in ("query", "key", "value", "kv_cache"):
            getattr(static, name).copy_(getattr(fresh, name))
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table"):
            getattr(static.common, name).copy_(getattr(fresh.common, name))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_cache = reference(fresh)
        out = static_out.cpu()
        assert torch.isfinite(out).all()
        assert torch.equal(static.kv_cache.cpu(), expected_cache)
        err = (out.double() - expected).norm() / expected.norm()
        assert err < REL_TOL[torch.bfloat16], f"replay seed {seed}: relative error {err:.3g}"


def compare_with_torch_backend(case: Case, tol: float) -> None:
    """The project's torch reference backend on the same inputs: same cache after write_kv, same output."""
    ours, our_cache = run_backend(case, "triton")
    theirs, their_cache = run_backend(case, "torch")
    real = int(case.common.query_start_loc_cpu[case.num_real_reqs])
    assert torch.equal(our_cache, their_cache)
    err = (ours[:real].double() - theirs[:real].double()).norm() / theirs[:real].double().norm()
    assert err < tol, f"triton vs torch backend: relative difference {err:.3g}"


HAS_TORCH_REF = importlib.util.find_spec("pellucid.attention.torch_ref") is not None


@needs_gpu
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TORCH_REF, reason="pellucid.attention.torch_ref is not written yet")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_agrees_with_torch_reference_backend(dtype: torch.dtype) -> None:
    for seed in range(3):
        q_lens, computed = random_lengths(20 + seed, seed > 0, 16)
        case = make_case(seed, q_lens, computed, 16, 8, 2, 64, dtype, "cuda")
        compare_with_torch_backend(case, REL_TOL[dtype])


INTERPRETER_CASES = [  # (seed, mixed, block_size, heads, kv_heads, head_dim, dtype)
    (0, False, 16, 4, 2, 64, torch.float32),
    (1, True, 16, 4, 4, 64, torch.float32),
    (2, True, 32, 8, 2, 32, torch.float16),
    (3, False, 16, 8, 1, 64, torch.float16),
]


def run_interpreter_cases() -> None:
    """Small cases on the CPU; needs TRITON_INTERPRET=1 set before triton was imported."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreter_runs_loaded_loop_bounds():
        return
    for seed, mixed, block_size, heads, kv_heads, head_dim, dtype in INTERPRETER_CASES:
        gen = torch.Generator().manual_seed(seed)
        if mixed:
            q_lens = [1, int(torch.randint(20, 90, (1,), generator=gen)), 1, int(torch.randint(5, 40, (1,), generator=gen))]
            computed = [int(torch.randint(30, 120, (1,), generator=gen)), 0, 7, block_size * 2 + 3]
        else:
            q_lens = [1, 1, 1]
            computed = torch.randint(1, 150, (3,), generator=gen).tolist()
        case = make_case(seed, q_lens, computed, block_size, heads, kv_heads, head_dim, dtype, "cpu",
                         num_padded_reqs=1, num_pad_rows=2)
        check_case(case)
        # the decode path with several splits, beyond what the CPU split heuristic picks
        if not mixed:
            from pellucid.attention.triton_backend import TritonAttentionBackend

            backend = TritonAttentionBackend(heads, kv_heads, head_dim, dtype, torch.device("cpu"))
            backend.decode_min_tokens_per_split = 16
            metadata = backend.build_metadata(case.common)
            assert metadata.num_splits > 1
            cache = case.kv_cache.clone()
            backend.write_kv(case.key, case.value, cache, case.common.slot_mapping)
            out = backend.forward(case.query, cache, metadata, case.scale)
            expected, _ = reference(case)
            err = (out.double() - expected).norm() / expected.norm()
            assert err < REL_TOL[dtype], f"split decode relative error {err:.3g}"
        if HAS_TORCH_REF:  # its padding convention differs (it rejects seq_len 0 with a query row): none here
            compare_with_torch_backend(make_case(seed, q_lens, computed, block_size, heads, kv_heads, head_dim,
                                                 dtype, "cpu"), REL_TOL[dtype])
    print("interpreter cases passed")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_under_interpreter() -> None:
    interpreted_checks(__file__, "interpreter cases passed")


if __name__ == "__main__" and "--interpret" in sys.argv:
    torch.set_num_threads(1)
    run_interpreter_cases()
