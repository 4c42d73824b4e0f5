"""The few-token mixture-of-experts path: one program per (token-expert entry, column tile), no token layout.

At decode sizes (a token or a few) every entry has its own expert, so grouping entries by expert
(moe_routing.py's layout, moe_gemm.py's 16-row tensor-core blocks) buys nothing and costs two launches
(routing, layout) plus a third for the top-k sum; each launch of a decode step waits for the one before it.
This path runs the layer's experts in two launches after the router GEMM:

- `route_gate_up_rows`: each program routes its token itself (softmax, top-k by rank, renormalisation, the
  same choices and arithmetic as moe_routing._route_kernel; column tile 0 stores the entry's expert id and
  weight), then streams BLOCK_N gate rows and BLOCK_N up rows of that expert against the token's row as a
  CUDA-core dot product (fp32 products summed over K once at the end) and stores silu(gate) * up for the
  entry: h [entries, I]. `gate_up_rows` is the same kernel given the expert ids (the traced path).
- `down_sum_rows`: program (token, column tile) streams BLOCK_N rows of down[e] for all of the token's top-k
  experts at once (a [top_k, BLOCK_N, BLOCK_K] tile per step, so each program keeps many loads in flight),
  weights each expert's output and sums them in float32: the top-k sum needs no launch of its own and no
  atomics (the result does not depend on the order programs run in).

Rounding is moe_gemm.py's (each expert output rounded to the activation dtype, silu, the product; the
weighted output rounded again; the top-k sum in float32, rounded once). Launch sizes depend on the token
count only, so CUDA graphs capture them, and nothing is read on the host.

Expert ids stay in range whatever the logits hold: a NaN row ranks no expert first, and an entry whose
rank matches nothing takes expert 0 (as the routing kernel does), so stale or garbage inputs in a CUDA-graph
replay cannot send a program outside the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel

# The rank comparison runs over [BLOCK_E, chunk] tiles of at most this many elements (registers per program).
_RANK_TILE = 4096


@dataclass(frozen=True)
class RowTile:
    block_n: int        # weight rows per program (gate/up: this many gate rows and as many up rows)
    block_k: int        # columns of the reduction dimension per loop step
    num_warps: int
    num_stages: int


@triton.jit
def _route_slot(row_ptr, slot, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RANK_CHUNK: tl.constexpr,
                RENORM: tl.constexpr):
    """(expert id, routing weight in float32) of choice `slot` for the router logits at row_ptr [E].

    Experts are ordered by logit, larger first, equal logits by lower index: the order of torch's softmax +
    topk (softmax is monotonic) and of the routing kernel. An expert's rank is how many experts come
    before it; the slot's expert is the one of that rank."""
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    x = tl.load(row_ptr + offs_e, mask=mask_e, other=float("-inf")).to(tl.float32)
    rank = tl.zeros([BLOCK_E], tl.int32)
    for c0 in tl.static_range(0, BLOCK_E, RANK_CHUNK):
        offs_c = c0 + tl.arange(0, RANK_CHUNK)
        mask_c = offs_c < E
        xc = tl.load(row_ptr + offs_c, mask=mask_c, other=float("-inf")).to(tl.float32)
        before = (xc[None, :] > x[:, None]) | ((xc[None, :] == x[:, None]) & (offs_c[None, :] < offs_e[:, None]))
        rank += tl.sum((before & mask_c[None, :]).to(tl.int32), axis=1)
    # NaN logits compare false everywhere, so several experts (or none) can share a rank: take the lowest
    # index of that rank, and expert 0 when none has it.
    expert = tl.min(tl.where((rank == slot) & mask_e, offs_e, BLOCK_E), axis=0)
    expert = tl.where(expert < E, expert, 0)
    p = tl.exp(x - tl.max(x, axis=0))
    probs = p / tl.sum(p, axis=0)
    weight = tl.sum(tl.where(offs_e == expert, probs, 0.0), axis=0)
    if RENORM:
        weight = weight / tl.sum(tl.where((rank < TOP_K) & mask_e, probs, 0.0), axis=0)
    return expert, weight


@triton.jit
def _gate_up_rows_kernel(x_ptr, logits_ptr, w_ptr, ids_ptr, weights_ptr, h_ptr, E, H, I, stride_xt, stride_lt,
                         stride_we, stride_wn, stride_ht, TOP_K: tl.constexpr, ROUTE: tl.constexpr,
                         RENORM: tl.constexpr, BLOCK_E: tl.constexpr, RANK_CHUNK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    # Entries on the first grid axis: the programs of one column tile for every entry run side by side, so
    # two tokens that chose one expert read its tile at about the same time (the second from L2).
    entry = tl.program_id(0)
    token = entry // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    wait_for_previous_kernel(PDL)       # the expert depends on the router GEMM's output: nothing to load before
    if ROUTE:
        expert, weight = _route_slot(logits_ptr + token.to(tl.int64) * stride_lt, entry % TOP_K, E, TOP_K,
                                     BLOCK_E, RANK_CHUNK, RENORM)
        first_tile = tl.program_id(1) == 0
        tl.store(ids_ptr + entry, expert, mask=first_tile)
        tl.store(weights_ptr + entry, weight.to(weights_ptr.dtype.element_ty), mask=first_tile)
    else:
        expert = tl.load(ids_ptr + entry)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_expert + safe_n[:, None] * stride_wn
    up_rows = w_expert + (safe_n + I)[:, None] * stride_wn
    x_row = x_ptr + token.to(tl.int64) * stride_xt
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(x_row + offs_k).to(tl.float32)
            wg = tl.load(gate_rows + offs_k[None, :])
            wu = tl.load(up_rows + offs_k[None, :])
        else:
            mask_k = offs_k < H
            a = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            wg = tl.load(gate_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            wu = tl.load(up_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0)
        acc_gate += wg.to(tl.float32) * a[None, :]
        acc_up += wu.to(tl.float32) * a[None, :]
    act_dtype = h_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(act_dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(act_dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(act_dtype).to(tl.float32)
    tl.store(h_ptr + entry.to(tl.int64) * stride_ht + offs_n, (act * up).to(act_dtype), mask=mask_n)


@triton.jit
def _down_sum_rows_kernel(h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, H, I, stride_ht, stride_we, stride_wn,
                          stride_ot, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    offs_s = tl.arange(0, K_POW2)
    mask_s = offs_s < TOP_K
    entries = token * TOP_K + offs_s
    wait_for_previous_kernel(PDL)       # ids, weights and h come from the kernels before
    expert = tl.load(ids_ptr + entries, mask=mask_s, other=0).to(tl.int64)
    routing = tl.load(weights_ptr + entries, mask=mask_s, other=0.0).to(tl.float32)
    w_rows = w_ptr + expert[:, None, None] * stride_we + safe_n[None, :, None] * stride_wn     # [S, N, 1]
    h_rows = h_ptr + entries[:, None] * stride_ht                                              # [S, 1]
    acc = tl.zeros([K_POW2, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(h_rows + offs_k[None, :], mask=mask_s[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, None, :], mask=mask_s[:, None, None], other=0.0)
        else:
            mask_k = offs_k < I
            a = tl.load(h_rows + offs_k[None, :], mask=mask_s[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, None, :], mask=mask_s[:, None, None] & mask_k[None, None, :],
                        other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
    act_dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(act_dtype).to(tl.float32) * routing[:, None]      # [S, N]
    y = tl.where(mask_s[:, None], y.to(act_dtype).to(tl.float32), 0.0)
    tl.store(out_ptr + token * stride_ot + offs_n, tl.sum(y, axis=0).to(act_dtype), mask=mask_n)


def _k_tile(tile: RowTile, k: int) -> tuple[int, bool]:
    """(BLOCK_K, EVEN_K): no wider than K's next power of two (small test shapes)."""
    block_k = min(tile.block_k, triton.next_power_of_2(k))
    return block_k, k % block_k == 0


def _launch_gate_up(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, top_k: int, route: bool, renormalize: bool, tile: RowTile
                    ) -> torch.Tensor:
    num_tokens = x.shape[0]
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    h = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return h
    block_e = triton.next_power_of_2(num_experts)
    block_k, even_k = _k_tile(tile, hidden)
    _gate_up_rows_kernel[(num_tokens * top_k, triton.cdiv(inter, tile.block_n))](
        x, logits, gate_up, ids, weights, h, num_experts, hidden, inter, x.stride(0), logits.stride(0),
        gate_up.stride(0), gate_up.stride(1), h.stride(0), TOP_K=top_k, ROUTE=route, RENORM=renormalize,
        BLOCK_E=block_e, RANK_CHUNK=max(1, min(block_e, _RANK_TILE // block_e)), BLOCK_N=tile.block_n,
        BLOCK_K=block_k, EVEN_K=even_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl_launch_options(x))
    return h


def route_gate_up_rows(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, top_k: int, renormalize: bool,
                       weights_dtype: torch.dtype, tile: RowTile) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int32, routing weights [T, k] in weights_dtype, h [T * k, I]) from x [T, H], router
    logits [T, E] (unit stride along E) and gate_up [E, 2I, H]: h[t * k + j] = silu(gate) * up of token t
    through its j-th expert."""
    num_tokens = x.shape[0]
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=x.device)
    h = _launch_gate_up(x, logits, gate_up, ids, weights, top_k, True, renormalize, tile)
    return ids, weights, h


def gate_up_rows(x: torch.Tensor, gate_up: torch.Tensor, ids: torch.Tensor, tile: RowTile) -> torch.Tensor:
    """h [T * k, I] for given expert ids [T, k] (contiguous, any integer dtype)."""
    return _launch_gate_up(x, x, gate_up, ids, ids, ids.shape[1], False, False, tile)


def down_sum_rows(h: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  tile: RowTile) -> torch.Tensor:
    """[T, H]: sum_j weights[t, j] * (h[t * k + j] @ down[ids[t, j]]^T); down [E, H, I], ids and weights [T, k]
    contiguous."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    out = torch.empty((num_tokens, hidden), dtype=h.dtype, device=h.device)
    if num_tokens == 0:
        return out
    block_k, even_k = _k_tile(tile, inter)
    _down_sum_rows_kernel[(num_tokens, triton.cdiv(hidden, tile.block_n))](
        h, down, ids, weights, out, hidden, inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=even_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_launch_options(h))
    return out
