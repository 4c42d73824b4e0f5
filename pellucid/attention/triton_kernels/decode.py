"""Split-KV (flash-decoding) paged attention for batches where every request has one query token.

Grid: (request, kv_head, split). One program reads one split of one request's KV for one KV head
and serves all query heads of that group at once, so each KV byte is read once per step. The split
boundaries are derived on the device from the request's sequence length, so any split count is
correct for any length: the count is only a performance knob, fixed on the host (CUDA-graph safe).

One launch per layer does everything a decode step needs from attention:
- With `key`/`value` given, the program whose split holds the newest position stores the new token's
  key and value at its slot (the work of write_kv) and attends to them from registers.
- When a request's keys fit in one split, that program writes the output directly. Otherwise each
  split stores its partial output and log-sum-exp, and the last split of a (request, kv_head) to
  finish (counted by an atomic ticket) merges them; it then resets the ticket for the next launch.
At batch 1 this is one kernel where write_kv, the split kernel and a reduce kernel were three.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.attention.triton_kernels.tile import attend_tile
from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _load_new_kv(key_ptr, value_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, q_row, kv_head, cache_head, store,
                 stride_key_t, stride_key_h, stride_value_t, stride_value_h, stride_cache_block, stride_cache_slot,
                 offs_d, d_mask, BLOCK_SIZE: tl.constexpr):
    """Token q_row's key and value for kv_head, also stored at its slot when `store` (slot -1 marks a
    padding row: never stored). The caller attends to them from registers, not from the slot."""
    k = tl.load(key_ptr + q_row * stride_key_t + kv_head * stride_key_h + offs_d, mask=d_mask, other=0.0)
    v = tl.load(value_ptr + q_row * stride_value_t + kv_head * stride_value_h + offs_d, mask=d_mask, other=0.0)
    if store:
        slot = tl.load(slot_mapping_ptr + q_row).to(tl.int64)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + cache_head
            tl.store(k_cache_ptr + dst + offs_d, k, mask=d_mask)
            tl.store(v_cache_ptr + dst + offs_d, v, mask=d_mask)
    return k, v


@triton.jit
def _attend_one_key(q, acc, m_i, l_i, k, v, scale_log2):
    """Fold one key/value [BLOCK_D] that every query row sees into (acc, m_i, l_i), rounding the
    probabilities to the value dtype as attend_tile does before its PV product."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale_log2
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    return acc, m_new, l_i


@triton.jit
def _merge_splits(partial_out_ptr, partial_lse_ptr, out_ptr, req, q_row, first_head, num_active,
                  stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
                  stride_out_t, stride_out_h, offs_d, d_mask,
                  GROUP: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[q_row, h] = the log-sum-exp weighted mean of the first num_active splits' partial outputs, for
    the GROUP heads from first_head. Partials are read past L1 (.cg): other programs wrote them."""
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_active
    for g in range(GROUP):
        head = first_head + g
        lse = tl.load(partial_lse_ptr + req * stride_pl_req + head * stride_pl_head + offs_s, mask=s_mask,
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        denom = tl.sum(w, 0)
        denom = tl.where(denom == 0.0, 1.0, denom)
        parts = tl.load(partial_out_ptr + req * stride_po_req + head * stride_po_head
                        + offs_s[:, None] * stride_po_split + offs_d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        result = tl.sum(parts * w[:, None], 0) / denom
        tl.store(out_ptr + q_row * stride_out_t + head * stride_out_h + offs_d,
                 result.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, tickets_ptr,
    key_ptr, value_ptr, slot_mapping_ptr,
    scale_log2, num_splits,
    stride_q_t, stride_q_h,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_block_table,
    stride_out_t, stride_out_h,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr,
    WRITE_KV: tl.constexpr, IEEE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    release_dependents(PDL)
    wait_for_previous_kernel(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_row = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    if q_end <= q_row:
        return  # padded request without a query row: nothing to compute, nothing to write
    seq_len = tl.load(seq_lens_ptr + req)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    num_active = tl.maximum(tl.cdiv(seq_len, tl.maximum(tokens_per_split, 1)), 1)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if split >= num_active:
        return  # empty split: it neither writes nor takes a ticket

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    cache_head = kv_head * stride_cache_head
    q = tl.load(q_ptr + q_row * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    # With WRITE_KV, the split holding position seq_len - 1 (the new token's) stores its key/value and
    # attends to it from registers; its cache loop stops one position short.
    holds_new_token = split == num_active - 1
    cache_end = end
    if WRITE_KV:
        new_k, new_v = _load_new_kv(key_ptr, value_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, q_row, kv_head,
                                    cache_head, holds_new_token, stride_key_t, stride_key_h, stride_value_t,
                                    stride_value_h, stride_cache_block, stride_cache_slot, offs_d, d_mask, BLOCK_SIZE)
        cache_end = tl.where(holds_new_token, tl.maximum(end - 1, start), end)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table_row_ptr = block_table_ptr + req * stride_block_table
    # The one query row of each head sits at position seq_len - 1: it sees every key of the split.
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + (seq_len - 1)
    for n0 in range(start, cache_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                                    cache_head, q_pos, cache_end, scale_log2, offs_n, offs_d, d_mask,
                                    stride_cache_block, stride_cache_slot,
                                    BLOCK_SIZE=BLOCK_SIZE, MASKED=True, IEEE_DOT=IEEE_DOT)
    if WRITE_KV:
        if holds_new_token:
            if end > start:     # seq_len 0 (a padding request) has no new token
                acc, m_i, l_i = _attend_one_key(q, acc, m_i, l_i, new_k, new_v, scale_log2)

    safe_l = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding) yields zeros, not NaN
    result = acc / safe_l[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    out_ptrs = out_ptr + q_row * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :]
    if not SPLIT:
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    elif num_active == 1:
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
        tl.store(partial_out_ptr + req * stride_po_req + heads[:, None] * stride_po_head
                 + split * stride_po_split + offs_d[None, :], result, mask=store_mask)
        tl.store(partial_lse_ptr + req * stride_pl_req + heads * stride_pl_head + split, lse, mask=g_mask)
        # Every thread's partial stores come before the ticket (an acq_rel atomic at GPU scope), so the
        # program that draws the last ticket sees every split's partials.
        tl.debug_barrier()
        ticket_ptr = tickets_ptr + req * tl.num_programs(1) + kv_head
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == num_active - 1:
            tl.debug_barrier()
            _merge_splits(partial_out_ptr, partial_lse_ptr, out_ptr, req, q_row, kv_head * GROUP, num_active,
                          stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
                          stride_out_t, stride_out_h, offs_d, d_mask, GROUP, BLOCK_S)
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")   # ready for the next launch


def decode_workspace(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partial_out [R, heads, splits, head_dim], partial_lse [R, heads, splits], tickets [R, kv_heads]):
    what decode_attention needs when num_splits > 1. Tickets start at zero and every launch leaves them
    at zero, so one workspace serves every layer and every replay."""
    partial_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    partial_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=device)
    tickets = torch.zeros(num_reqs, num_kv_heads, dtype=torch.int32, device=device)
    return partial_out, partial_lse, tickets


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, scale: float,
    num_splits: int, workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    block_n: int, num_warps: int, num_stages: int,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """query/out: [T, heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, kv_heads, head_dim].

    Row query_start_loc[r] of `out` is written for each request r with one query row. `workspace`
    (from decode_workspace) is needed when num_splits > 1. `new_kv` = (key, value [T, kv_heads,
    head_dim], slot_mapping [>= T]) stores each row's new key/value at its slot first (the cache must
    not hold them yet for these positions: this launch writes them); None when write_kv already ran.
    """
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    split = num_splits > 1
    if split and workspace is None:
        raise ValueError("decode_attention with num_splits > 1 needs the decode_workspace tensors")
    po, pl, tickets = workspace if split else (out, out, seq_lens)
    if split and (po.shape[:3] != (num_reqs, num_heads, num_splits) or tickets.shape != (num_reqs, num_kv_heads)):
        raise ValueError(f"decode workspace {tuple(po.shape)} / {tuple(tickets.shape)} does not fit {num_reqs} "
                         f"requests, {num_heads} heads, {num_kv_heads} kv heads and {num_splits} splits")
    key, value, slot_mapping = new_kv if new_kv is not None else (query, query, seq_lens)
    if new_kv is not None:
        if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape or key.dtype != k_cache.dtype:
            raise ValueError(f"new key/value {tuple(key.shape)} {tuple(value.shape)} {key.dtype} do not fit the "
                             f"cache's {num_kv_heads} heads of {head_dim} ({k_cache.dtype})")
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            raise ValueError("decode_attention needs the head dimension of the new key/value contiguous")
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        out, po, pl, tickets, key, value, slot_mapping,
        scale * 1.4426950408889634, num_splits,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        po.stride(0) if split else 0, po.stride(1) if split else 0, po.stride(2) if split else 0,
        pl.stride(0) if split else 0, pl.stride(1) if split else 0,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(num_splits), SPLIT=split,
        WRITE_KV=new_kv is not None, IEEE_DOT=query.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages, **pdl_launch_options(query),
    )
