"""Mixture-of-experts routing and the token layout the grouped GEMMs read, without a host sync.

Routing (`_route_kernel`): per token a softmax over the router logits in float32, the top-k experts (equal
probabilities: the lowest expert index first), optionally renormalised to sum to 1, stored in the
weights tensor's dtype (Qwen rounds them to the logits' dtype, Mixtral keeps float32).

Layout: the token-expert pairs ("entries", entry n = token * top_k + slot) grouped by expert into blocks of
BLOCK_M rows, each expert's entries padded to a whole number of blocks:
- `sorted_entries[block * BLOCK_M + i]`: the entry in row i of a block (only rows below `block_rows` hold one);
- `block_expert[block]`: the block's expert, -1 past the last block;
- `block_rows[block]`: how many of its rows hold an entry.
The number of blocks is at most `max_blocks(entries, experts, BLOCK_M)`, so every buffer and launch grid has
a size known on the host, and a CUDA graph replays it for any routing.

Two launches per layer: `_route_kernel`, many programs of a few tokens each (one warp, so the top-k
reductions stay within it), and `_layout_kernel`, one program that counts the entries per expert (an
atomic increment of the expert's counter gives each entry its row; rows within an expert come in any order,
and every GEMM row is computed on its own, so results do not depend on it), takes the padded prefix sums and
scatters the entries. The program zeroes its own counters first: nothing carries over between calls.
A single token (a batch-1 decode step) takes one launch: `_route_kernel` lays out its k entries itself.
Measured on an H100 (BENCHMARKS.md, issue 19, round 4): one MoE layer's routing + layout 6.6 -> 3.1 us,
the Qwen3-30B-A3B batch-1 decode step 3.54 -> 3.32-3.36 ms.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel

_ROUTE_BLOCK_T = 4
_ENTRY_BLOCK = 1024
_LAYOUT_BLOCK_B = 64


def max_blocks(num_entries: int, num_experts: int, block_m: int) -> int:
    """An upper bound of sum over experts of ceil(count / block_m) for counts summing to num_entries."""
    return min(num_entries, triton.cdiv(num_entries, block_m) + min(num_experts, num_entries))


# Below every expert's key: an expert already chosen, or the empty second of a pair.
_TAKEN = tl.constexpr(-(2 ** 63))


@triton.jit
def _top_two(a1, a2, b1, b2):
    """The two largest of two descending pairs (keys are distinct, except _TAKEN)."""
    first = tl.maximum(a1, b1)
    second = tl.where(a1 >= b1, tl.maximum(a2, b1), tl.maximum(a1, b2))
    return first, second


@triton.jit
def _record(ids, weights, offs_k, slot, key, BLOCK_E: tl.constexpr):
    """Put the expert of `key` ([BLOCK_T] int64) and its probability in column `slot` of ids and weights."""
    expert = BLOCK_E - 1 - (key & 0xFFFFFFFF).to(tl.int32)
    prob = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    ids = tl.where(offs_k[None, :] == slot, expert[:, None], ids)
    weights = tl.where(offs_k[None, :] == slot, prob[:, None], weights)
    return ids, weights


@triton.jit
def _top_k_by_pairs(probs, offs_e, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, K_POW2: tl.constexpr):
    """(ids, probabilities) [1, K_POW2] of the top k of probs [1, BLOCK_E], for one token's program.

    One int64 key per expert orders by probability, then by the lower index (a non-negative float's bits
    order as integers; the low word holds BLOCK_E - 1 - index), so each reduction yields the next two experts:
    k / 2 dependent reductions instead of k pairs of them. Measured in the Qwen3-30B-A3B engine (H200,
    BENCHMARKS.md issue 19 round 9): batch 1 2.448-2.452 -> 2.440-2.441 ms/step; with four tokens per
    program (batch 64 and 256) it was slower (more shuffles per step), so those keep _top_k_by_max."""
    offs_k = tl.arange(0, K_POW2)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = (bits << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)[None, :]
    taken = tl.full(keys.shape, _TAKEN, tl.int64)
    ids = tl.zeros([1, K_POW2], tl.int32)
    weights = tl.zeros([1, K_POW2], tl.float32)
    for j in tl.static_range(0, TOP_K, 2):
        first, second = tl.reduce((keys, taken), 1, _top_two)
        ids, weights = _record(ids, weights, offs_k, j, first, BLOCK_E)
        if j + 1 < TOP_K:
            ids, weights = _record(ids, weights, offs_k, j + 1, second, BLOCK_E)
        keys = tl.where((keys == first[:, None]) | (keys == second[:, None]), _TAKEN, keys)
    return ids, weights


@triton.jit
def _top_k_by_max(probs, offs_e, E, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  K_POW2: tl.constexpr):
    """(ids, probabilities) [BLOCK_T, K_POW2] of the top k of each row of probs [BLOCK_T, BLOCK_E]: per slot
    the largest probability, then the lowest index holding it."""
    offs_k = tl.arange(0, K_POW2)
    ids = tl.zeros([BLOCK_T, K_POW2], tl.int32)
    weights = tl.zeros([BLOCK_T, K_POW2], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        idx = tl.min(tl.where(probs == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        idx = tl.where(idx < E, idx, 0)      # a NaN row matches nothing: expert 0, with its NaN weight
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
        weights = tl.where(offs_k[None, :] == j, best[:, None], weights)
        probs = tl.where(offs_e[None, :] == idx[:, None], -1.0, probs)
    return ids, weights


@triton.jit
def _route_kernel(logits_ptr, stride_l, ids_ptr, weights_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, T, E,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, K_POW2: tl.constexpr,
                  RENORM: tl.constexpr, ONE_TOKEN_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """Route BLOCK_T tokens: their top-k expert ids [T, k] int32 and weights [T, k] (the weights' dtype).
    ONE_TOKEN_LAYOUT (T = 1, BLOCK_T = 1): also the token's layout, one block per entry in expert order."""
    release_dependents(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    wait_for_previous_kernel(PDL)
    x = tl.load(logits_ptr + offs_t.to(tl.int64)[:, None] * stride_l + offs_e[None, :],
                mask=mask_t[:, None] & mask_e[None, :], other=0.0).to(tl.float32)
    x = tl.where(mask_e[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    probs = tl.where(mask_e[None, :], probs, -2.0)         # never chosen over a real expert
    offs_k = tl.arange(0, K_POW2)
    if BLOCK_T == 1:
        ids, weights = _top_k_by_pairs(probs, offs_e, TOP_K, BLOCK_E, K_POW2)
    else:
        ids, weights = _top_k_by_max(probs, offs_e, E, TOP_K, BLOCK_T, BLOCK_E, K_POW2)
    if RENORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    mask = mask_t[:, None] & (offs_k < TOP_K)[None, :]
    out = offs_t.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
    tl.store(ids_ptr + out, ids, mask=mask)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=mask)
    if ONE_TOKEN_LAYOUT:
        # Entry j's block is its rank by expert (the k experts differ: every key is distinct), so the
        # blocks run in expert order, as the layout kernel's do.
        chosen = tl.reshape(ids, [K_POW2])
        valid = offs_k < TOP_K
        before = (chosen[None, :] < chosen[:, None]) | ((chosen[None, :] == chosen[:, None])
                                                       & (offs_k[None, :] < offs_k[:, None]))
        block = tl.sum((before & valid[None, :]).to(tl.int32), axis=1)
        tl.store(sorted_ptr + block * BLOCK_M, offs_k, mask=valid)
        tl.store(block_expert_ptr + block, chosen, mask=valid)
        tl.store(block_rows_ptr + block, tl.full([K_POW2], 1, tl.int32), mask=valid)


@triton.jit
def _layout_kernel(ids_ptr, counts_ptr, ranks_ptr, starts_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
                   num_entries, E, num_blocks, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """One program: count the entries per expert, then lay them out in blocks of BLOCK_M rows by expert.
    Phases that read what other threads of this program wrote are separated by barriers (a block's global
    writes are visible to the block after one)."""
    release_dependents(PDL)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    wait_for_previous_kernel(PDL)
    tl.store(counts_ptr + offs_e, tl.zeros([BLOCK_E], tl.int32), mask=mask_e)
    tl.debug_barrier()
    for n0 in range(0, num_entries, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < num_entries
        expert = tl.load(ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int32)
        rank = tl.atomic_add(counts_ptr + expert, 1, mask=mask_n, sem="relaxed")
        tl.store(ranks_ptr + offs_n, rank, mask=mask_n)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + offs_e, mask=mask_e, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    tl.store(starts_ptr + offs_e, block_start, mask=mask_e)
    # The expert of block b is the first whose blocks end after b; blocks past the last one get -1.
    for b0 in range(0, num_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        before = (block_end[None, :] <= offs_b[:, None]) & mask_e[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        own = offs_e[None, :] == expert[:, None]
        first = tl.sum(tl.where(own, block_start[None, :], 0), axis=1)
        count = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        rows = tl.minimum(count - (offs_b - first) * BLOCK_M, BLOCK_M)
        valid = expert < E
        mask_b = offs_b < num_blocks
        tl.store(block_expert_ptr + offs_b, tl.where(valid, expert, -1), mask=mask_b)
        tl.store(block_rows_ptr + offs_b, tl.where(valid, rows, 0), mask=mask_b)
    tl.debug_barrier()
    for n0 in range(0, num_entries, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < num_entries
        expert = tl.load(ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int32)
        rank = tl.load(ranks_ptr + offs_n, mask=mask_n, other=0)
        dest = tl.load(starts_ptr + expert, mask=mask_n, other=0) * BLOCK_M + rank
        tl.store(sorted_ptr + dest, offs_n, mask=mask_n)


class ExpertLayout:
    """The token layout of one routing (see the module docstring), for grouped GEMMs with `block_m` rows."""

    def __init__(self, sorted_entries: torch.Tensor, block_expert: torch.Tensor, block_rows: torch.Tensor,
                 block_m: int, top_k: int) -> None:
        self.sorted_entries = sorted_entries
        self.block_expert = block_expert
        self.block_rows = block_rows
        self.block_m = block_m
        self.top_k = top_k

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def route_and_layout(logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout]:
    """(expert ids [T, k] int32, routing weights [T, k] in weights_dtype, layout) from router logits [T, E].
    One token (a batch-1 decode step) takes one launch: the routing kernel lays out its k entries itself,
    a block each, which is the layout kernel's result since the k experts differ."""
    num_tokens, num_experts = logits.shape
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=logits.device)
    one_token = num_tokens == 1
    layout = _empty_layout(num_tokens, top_k, num_experts, block_m, logits.device)
    if num_tokens:
        block_t = 1 if one_token else _ROUTE_BLOCK_T
        _route_kernel[(triton.cdiv(num_tokens, block_t),)](
            logits, logits.stride(0), ids, weights, layout.sorted_entries, layout.block_expert, layout.block_rows,
            num_tokens, num_experts, TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(num_experts),
            K_POW2=triton.next_power_of_2(top_k), RENORM=renormalize, ONE_TOKEN_LAYOUT=one_token, BLOCK_M=block_m,
            num_warps=1, **pdl_launch_options(logits))
        if not one_token:
            _lay_out(ids, layout, num_experts)
    return ids, weights, layout


def _empty_layout(num_tokens: int, top_k: int, num_experts: int, block_m: int, device) -> ExpertLayout:
    """Unfilled buffers of the layout of num_tokens x top_k entries (sized for any routing)."""
    blocks = max_blocks(num_tokens * top_k, num_experts, block_m)
    sorted_entries = torch.empty(max(blocks, 1) * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=device)
    return ExpertLayout(sorted_entries, block_expert, block_rows, block_m, top_k)


def layout_for(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """The layout of expert ids [T, k] (any integer dtype): entries grouped by expert in blocks of block_m rows."""
    ids = ids.contiguous()
    num_tokens, top_k = ids.shape
    layout = _empty_layout(num_tokens, top_k, num_experts, block_m, ids.device)
    _lay_out(ids, layout, num_experts)
    return layout


def _lay_out(ids: torch.Tensor, layout: ExpertLayout, num_experts: int) -> None:
    """Fill `layout` for contiguous ids [T, k] with the layout kernel."""
    entries = ids.numel()
    if not entries:
        return
    blocks = layout.num_blocks
    scratch = torch.empty(2 * num_experts + entries, dtype=torch.int32, device=ids.device)
    counts, starts, ranks = scratch[:num_experts], scratch[num_experts:2 * num_experts], scratch[2 * num_experts:]
    _layout_kernel[(1,)](ids, counts, ranks, starts, layout.sorted_entries, layout.block_expert, layout.block_rows,
                         entries, num_experts, blocks, BLOCK_E=triton.next_power_of_2(num_experts),
                         BLOCK_M=layout.block_m, BLOCK_B=min(_LAYOUT_BLOCK_B, triton.next_power_of_2(blocks)),
                         BLOCK_N=min(_ENTRY_BLOCK, triton.next_power_of_2(entries)), num_warps=4,
                         **pdl_launch_options(ids))
