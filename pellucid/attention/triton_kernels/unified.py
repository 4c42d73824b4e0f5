"""Paged attention for any batch: prefill, chunked prefill over a cached prefix, decode, or a mix.

Each program takes BLOCK_Q consecutive query tokens of one request times all GROUP query heads of
one KV head (BLOCK_M = BLOCK_Q * GROUP rows), so a KV tile is loaded once for the whole group.
Query token i of a request sits at absolute position num_computed + i and sees keys 0..that
position. The grid is an upper bound on the number of query blocks derived from host sizes
(num_token_rows // BLOCK_Q + num_reqs); each program finds its request by binary search over
query_start_loc, so nothing is read back to the host and the launch is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales
from pellucid.attention.triton_kernels.tile import attend_tile, half_dot


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2, v_scale, num_reqs,
    stride_q_t, stride_q_h,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_block_table,
    stride_out_t, stride_out_h,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
    HALF_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # request r owns programs [query_start_loc[r] // BLOCK_Q + r, ...): find the last start <= pid
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_start <= pid, mid + 1, lo)
        hi = tl.where(mid_start <= pid, hi, mid)
    req = lo - 1

    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_first = (pid - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_first >= q_len:
        return  # spare program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + req)
    num_computed = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_first + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_begin + tok[:, None]) * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=q_mask, other=0.0)
    if HALF_DOT:    # an FP8 cache under a bfloat16 model: its tiles convert to float16 in one instruction per pair
        q = q.to(tl.float16)
    q_pos = num_computed + tok

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row_ptr = block_table_ptr + req * stride_block_table
    cache_head = kv_head * stride_cache_head
    # keys before the block's first query position are visible to all its rows: no masks needed
    kv_end = tl.minimum(seq_len, num_computed + q_first + BLOCK_Q)
    full_end = ((num_computed + q_first) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                                    cache_head, q_pos, kv_end, scale_log2, offs_n, offs_d, d_mask,
                                    stride_cache_block, stride_cache_slot,
                                    BLOCK_SIZE=BLOCK_SIZE, MASKED=False, IEEE_DOT=IEEE_DOT)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                                    cache_head, q_pos, kv_end, scale_log2, offs_n, offs_d, d_mask,
                                    stride_cache_block, stride_cache_slot,
                                    BLOCK_SIZE=BLOCK_SIZE, MASKED=True, IEEE_DOT=IEEE_DOT)

    safe_l = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / safe_l[:, None] * v_scale     # an FP8 cache's value scale (1.0 otherwise: exact)
    tl.store(out_ptr + (q_begin + tok[:, None]) * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :],
             result.to(out_ptr.dtype.element_ty), mask=q_mask)


def unified_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, scale: float,
    block_m: int, block_n: int, num_warps: int, num_stages: int, kv_scales: KvScales = UNIT_KV_SCALES,
) -> None:
    """query/out: [T, heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, kv_heads, head_dim].

    Writes the rows query_start_loc[0]:query_start_loc[num_reqs] of `out`. `kv_scales`: an FP8 cache's (k_scale
    joins the softmax scale, v_scale scales the output).
    """
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (query.shape[0] // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out,
        scale * kv_scales.k * 1.4426950408889634, kv_scales.v, num_reqs,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        IEEE_DOT=query.dtype == torch.float32, HALF_DOT=half_dot(query.dtype, k_cache.dtype), num_warps=num_warps,
        num_stages=num_stages,
    )
