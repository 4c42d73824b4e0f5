"""Split-KV (flash-decoding) paged attention for batches where every request has one query token.

Grid: (request, kv_head, split). One program reads one split of one request's KV for one KV head
and serves all query heads of that group at once, so each KV byte is read once per step. The split
boundaries are derived on the device from the request's sequence length, so any split count is
correct for any length: the count is only a performance knob, fixed on the host (CUDA-graph safe).
With one split the kernel writes the output directly; otherwise a reduce kernel merges the splits
by their log-sum-exp.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales, is_fp8
from pellucid.attention.norm_rotary import QKNormRotary
from pellucid.attention.triton_kernels.norm_rotary import norm_rotate, rotary_factors
from pellucid.attention.triton_kernels.tile import attend_loaded, attend_tile, half_dot, kv_tile_rows
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2, v_scale, num_splits,
    stride_q_t, stride_q_h,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_block_table,
    stride_out_t, stride_out_h,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    k_ptr, v_ptr, stride_k_t, stride_k_h, stride_v_t, stride_v_h, q_weight_ptr, k_weight_ptr, q_eps, k_eps,
    cos_sin_ptr, stride_cs_kind, stride_cs_pos, positions_ptr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT_OUTPUT: tl.constexpr, IEEE_DOT: tl.constexpr,
    NORM_ROTARY: tl.constexpr, HALF_DOT: tl.constexpr, PIPELINE_KV: tl.constexpr, PDL: tl.constexpr,
):
    """NORM_ROTARY: q_ptr, k_ptr and v_ptr are the raw projections of this step's tokens; the kernel applies
    the q/k RMSNorm and rotary itself (see decode_attention) and stores the new K/V in the cache."""
    release_dependents(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Ahead of the wait (pdl.py's rule): the step's metadata and the split's first KV tile, except the
    # request's newest position, whose K/V this step's KV write stores; it is read after the wait.
    q_row = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    end = tl.where(q_end > q_row, end, 0)       # a padded request without a query row reads nothing
    if (start >= seq_len) & (split > 0):
        # An empty split (a context shorter than the split count captured for the longest one) leaves at
        # once instead of holding its SM through the wait: the next kernels' programs (the o projection)
        # become resident and load their weights there. Split 0 of every request still waits (pdl.py).
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    cache_head = kv_head * stride_cache_head
    block_table_row_ptr = block_table_ptr + req * stride_block_table
    newest = seq_len - 1
    pos, n_mask, row = kv_tile_rows(start, block_table_row_ptr, cache_head, end, offs_n,
                                    stride_cache_block, stride_cache_slot, BLOCK_SIZE=BLOCK_SIZE, MASKED=True)
    earlier = (n_mask & (pos != newest))[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=earlier, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=earlier, other=0.0)
    holds_newest = (newest >= start) & (newest < end)
    newest_slot = tl.where(holds_newest, newest, 0)      # an index always inside the block-table row
    newest_block = tl.load(block_table_row_ptr + newest_slot // BLOCK_SIZE)
    newest_row = newest_block.to(tl.int64) * stride_cache_block + (newest_slot % BLOCK_SIZE) * stride_cache_slot \
        + cache_head
    if NORM_ROTARY:     # positions are step metadata and the norm weights and cos/sin table never change
        partner, cos, sin = rotary_factors(cos_sin_ptr, stride_cs_kind, stride_cs_pos, positions_ptr, q_row, offs_d,
                                           d_mask, HEAD_DIM, q_ptr)
        q_w = tl.load(q_weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        q_wp = tl.load(q_weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
        k_w = tl.load(k_weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        k_wp = tl.load(k_weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)

    if q_end <= q_row:
        return  # padded request without a query row: nothing to compute, nothing to write

    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q_mask = g_mask[:, None] & d_mask[None, :]
    if NORM_ROTARY:
        # Every activation load is issued before any arithmetic waits on one: one L2 round trip after the wait,
        # not one for q, then k, then v (0.2-0.4 us per layer of the Qwen3-30B-A3B shape on an H200).
        q_rows = q_ptr + q_row * stride_q_t + heads[:, None] * stride_q_h
        k_row = k_ptr + q_row * stride_k_t + kv_head * stride_k_h + tl.zeros([1, 1], tl.int64)
        q_raw = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
        q_raw_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
        k_raw = tl.load(k_row + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k_raw_partner = tl.load(k_row + partner[None, :], mask=d_mask[None, :], other=0.0)
        v_new = tl.load(v_ptr + q_row * stride_v_t + kv_head * stride_v_h + offs_d, mask=d_mask, other=0.0)
        q = norm_rotate(q_raw, q_raw_partner, offs_d, q_w, q_wp, q_eps, cos, sin, HEAD_DIM)
        k_new = tl.reshape(norm_rotate(k_raw, k_raw_partner, offs_d, k_w, k_wp, k_eps, cos, sin, HEAD_DIM), [BLOCK_D])
        # The split holding the newest position stores its K/V. Its first tile takes them from registers (below);
        # a later tile reads them back from the cache, and only then must a barrier make the store visible to
        # the whole program first.
        store_mask = offs_d < tl.where(holds_newest, HEAD_DIM, 0)
        tl.store(k_cache_ptr + newest_row + offs_d, k_new, mask=store_mask)
        tl.store(v_cache_ptr + newest_row + offs_d, v_new, mask=store_mask)
        if newest >= start + BLOCK_N:
            tl.debug_barrier()
    else:
        q = tl.load(q_ptr + q_row * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :], mask=q_mask, other=0.0)
        # newest_row is a valid row even when no position of this split is the newest; then no pos matches.
        k_new = tl.load(k_cache_ptr + newest_row + offs_d, mask=d_mask, other=0.0)
        v_new = tl.load(v_cache_ptr + newest_row + offs_d, mask=d_mask, other=0.0)
    # An FP8 cache's values become the queries' dtype exactly (no-ops for a cache in that dtype; the fused norm +
    # rotary path runs only then).
    if HALF_DOT:
        q = q.to(tl.float16)
    is_newest = (pos == newest)[:, None]
    k = tl.where(is_newest, k_new.to(q.dtype)[None, :], k.to(q.dtype))
    v = tl.where(is_newest, v_new.to(q.dtype)[None, :], v.to(q.dtype))

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # The one query row of each head sits at position seq_len - 1: it sees every key of the split.
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + newest
    if start < end:
        acc, m_i, l_i = attend_loaded(q, acc, m_i, l_i, k, v, pos, n_mask, q_pos, scale_log2,
                                      MASKED=True, IEEE_DOT=IEEE_DOT)
    if PIPELINE_KV:
        for n0 in range(start + BLOCK_N, end, BLOCK_N):
            acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                                        cache_head, q_pos, end, scale_log2, offs_n, offs_d, d_mask,
                                        stride_cache_block, stride_cache_slot,
                                        BLOCK_SIZE=BLOCK_SIZE, MASKED=True, IEEE_DOT=IEEE_DOT)
    else:
        # An FP8 cache's tiles go from global memory to registers, are converted there, and reach the tensor cores
        # through shared memory as 16-bit values. Software-pipelined, they would be staged in shared memory as 8-bit
        # values, which leave it through narrow loads: 1.1-1.5x slower on an H200 (BENCHMARKS.md, "FP8 KV cache").
        for n0 in tl.range(start + BLOCK_N, end, BLOCK_N, num_stages=1):
            acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                                        cache_head, q_pos, end, scale_log2, offs_n, offs_d, d_mask,
                                        stride_cache_block, stride_cache_slot,
                                        BLOCK_SIZE=BLOCK_SIZE, MASKED=True, IEEE_DOT=IEEE_DOT)

    safe_l = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding) yields zeros, not NaN
    result = acc / safe_l[:, None] * v_scale     # an FP8 cache's value scale (1.0 otherwise: exact)
    store_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUTPUT:
        tl.store(out_ptr + q_row * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
        tl.store(partial_out_ptr + req * stride_po_req + heads[:, None] * stride_po_head
                 + split * stride_po_split + offs_d[None, :], result, mask=store_mask)
        tl.store(partial_lse_ptr + req * stride_pl_req + heads * stride_pl_head + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    num_splits,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    stride_out_t, stride_out_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    release_dependents(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + req)      # step metadata: ahead of the wait (pdl.py)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    wait_for_previous_kernel(PDL)
    if q_end <= q_row:
        return
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    # same split boundaries as the split kernel; split 0 always wrote (zeros when seq_len == 0)
    active = tl.maximum(tl.cdiv(seq_len, tl.maximum(tokens_per_split, 1)), 1)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < active
    # both loads issued before the weights' arithmetic waits on the first: one L2 round trip, not two
    lse = tl.load(partial_lse_ptr + req * stride_pl_req + head * stride_pl_head + offs_s,
                  mask=s_mask, other=float("-inf"))
    parts = tl.load(partial_out_ptr + req * stride_po_req + head * stride_po_head
                    + offs_s[:, None] * stride_po_split + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    result = tl.sum(parts * w[:, None], 0) / denom
    tl.store(out_ptr + q_row * stride_out_t + head * stride_out_h + offs_d,
             result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, scale: float,
    num_splits: int, partial_out: torch.Tensor | None, partial_lse: torch.Tensor | None,
    block_n: int, num_warps: int, num_stages: int, norm_rotary: QKNormRotary | None = None,
    kv_scales: KvScales = UNIT_KV_SCALES,
) -> None:
    """query/out: [T, heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, kv_heads, head_dim].

    Row query_start_loc[r] of `out` is written for each request r with one query row.
    partial_out [R, heads, num_splits, head_dim] and partial_lse [R, heads, num_splits] (float32) are
    the split workspace, needed when num_splits > 1.
    With `norm_rotary`, query and norm_rotary.key / .value are this step's raw projections: each program
    norms and rotates its query heads and the new key itself, and the program whose split holds a request's
    newest position stores its key and value in the cache (at the position's block-table slot), so no
    separate q/k norm + rotary kernel or KV write runs.
    `kv_scales`: an FP8 cache's (pellucid.attention.kv_dtype); k_scale joins the softmax scale and v_scale scales the
    output, so the tiles are multiplied as stored.
    An FP8 cache's tiles are loaded to registers without software pipelining and converted there (to float16 for
    bfloat16 queries: half_dot), which makes FP8 decode 0.75-0.9x the model-dtype cache's time (BENCHMARKS.md,
    "FP8 KV cache").
    """
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    direct = num_splits == 1
    if not direct and (partial_out is None or partial_lse is None):
        raise ValueError("decode_attention with num_splits > 1 needs the partial_out/partial_lse workspace")
    po = partial_out if not direct else out
    pl = partial_lse if not direct else out
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        out, po, pl,
        scale * kv_scales.k * 1.4426950408889634, kv_scales.v, num_splits,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        0 if direct else po.stride(0), 0 if direct else po.stride(1), 0 if direct else po.stride(2),
        0 if direct else pl.stride(0), 0 if direct else pl.stride(1),
        **_norm_rotary_args(norm_rotary, query),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT_OUTPUT=direct,
        IEEE_DOT=query.dtype == torch.float32, NORM_ROTARY=norm_rotary is not None,
        HALF_DOT=half_dot(query.dtype, k_cache.dtype), PIPELINE_KV=not is_fp8(k_cache.dtype), num_warps=num_warps,
        num_stages=num_stages, **pdl_launch_options(query),
    )
    if direct:
        return
    _decode_reduce_kernel[(num_reqs, num_heads)](
        po, pl, seq_lens, query_start_loc, out,
        num_splits,
        po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=block_n,
        num_warps=4 if head_dim >= 128 else 2, **pdl_launch_options(query),
    )


def _norm_rotary_args(norm_rotary: QKNormRotary | None, query: torch.Tensor) -> dict[str, Any]:
    """The split kernel's q/k norm + rotary arguments (placeholders without norm_rotary)."""
    if norm_rotary is None:
        return {"k_ptr": query, "v_ptr": query, "stride_k_t": 0, "stride_k_h": 0, "stride_v_t": 0, "stride_v_h": 0,
                "q_weight_ptr": query, "k_weight_ptr": query, "q_eps": 0.0, "k_eps": 0.0, "cos_sin_ptr": query,
                "stride_cs_kind": 0, "stride_cs_pos": 0, "positions_ptr": query}
    n = norm_rotary
    return {"k_ptr": n.key, "v_ptr": n.value, "stride_k_t": n.key.stride(0), "stride_k_h": n.key.stride(1),
            "stride_v_t": n.value.stride(0), "stride_v_h": n.value.stride(1), "q_weight_ptr": n.q_weight,
            "k_weight_ptr": n.k_weight, "q_eps": n.q_eps, "k_eps": n.k_eps, "cos_sin_ptr": n.cos_sin_cache,
            "stride_cs_kind": n.cos_sin_cache.stride(0), "stride_cs_pos": n.cos_sin_cache.stride(1),
            "positions_ptr": n.positions}
