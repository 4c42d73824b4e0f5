"""One step of online-softmax attention over a tile of paged KV, shared by the decode and unified kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.attention.kv_dtype import is_fp8


@triton.jit
def kv_tile_rows(n0, block_table_row_ptr, cache_head, kv_end, offs_n, stride_cache_block, stride_cache_slot,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Positions n0..n0+BLOCK_N, which of them lie before kv_end, and their rows' offsets in the KV cache."""
    pos = n0 + offs_n
    n_mask = pos < kv_end
    if MASKED:
        block = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        block = tl.load(block_table_row_ptr + pos // BLOCK_SIZE)
    row = block.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + cache_head
    return pos, n_mask, row


@triton.jit
def attend_loaded(q, acc, m_i, l_i, k, v, pos, n_mask, q_pos, scale_log2,
                  MASKED: tl.constexpr, IEEE_DOT: tl.constexpr):
    """Fold the loaded keys k and values v [BLOCK_N, BLOCK_D] at `pos` into (acc, m_i, l_i); when MASKED,
    only keys in n_mask and at most each row's q_pos count."""
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    # The callers' first tile holds a key every row sees, so m_new is finite from then on and no row is NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def attend_tile(q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, block_table_row_ptr, cache_head,
                q_pos, kv_end, scale_log2, offs_n, offs_d, d_mask,
                stride_cache_block, stride_cache_slot,
                BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, IEEE_DOT: tl.constexpr):
    """Fold keys n0..n0+BLOCK_N (those before kv_end and at most each row's q_pos when MASKED) into
    (acc, m_i, l_i). Unmasked tiles must lie wholly before kv_end and every row's q_pos."""
    pos, n_mask, row = kv_tile_rows(n0, block_table_row_ptr, cache_head, kv_end, offs_n, stride_cache_block,
                                    stride_cache_slot, BLOCK_SIZE=BLOCK_SIZE, MASKED=MASKED)
    if MASKED:
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    # An FP8 cache's values become the queries' dtype exactly (a no-op for a cache in that dtype).
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    return attend_loaded(q, acc, m_i, l_i, k, v, pos, n_mask, q_pos, scale_log2, MASKED=MASKED, IEEE_DOT=IEEE_DOT)


def half_dot(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the attention kernels multiply in float16 rather than the queries' bfloat16: on an FP8 cache, whose
    values float16 holds exactly and converts to in one instruction per pair (to bfloat16 it takes several), as it
    holds the bfloat16 queries (but for their tiniest values) and the probabilities more finely."""
    return is_fp8(cache_dtype) and query_dtype == torch.bfloat16
