"""A small-vocabulary draw in one launch: greedy argmax, or the exponential race over the top-k / top-p set.

Qwen3-Omni's code predictor draws 15 codes a frame, one after the other, each from 2,048 logits
(pellucid.models.qwen3_omni.code_predictor.top_k_top_p_race is the torch code). There the draw is a
dozen launches (topk, softmax, a reversed cumulative sum, gathers, the argmaxes, a select), more time
than the lm_head GEMM before it. Here one program per row does it all in registers:

- greedy rows: the first index of the largest logit (torch.argmax);
- sampling rows: every logit gets an order key (its float bits made monotone, then the lower index first
  among equal values), the keys are sorted ascending, the last TOP_K are the top k; their softmax, its
  cumulative sum in ascending order (the mass at or below each token, as the sampler's ascending sort
  computes it), the top-p cut (mass > 1 - top_p; the most likely token always stays), and the race
  argmax(p / noise[token]) with the row's Exp(1) noise.

The logits are read in the model's dtype and widened to float32 here (no separate .float() launch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pellucid.kernels.pdl import pdl_launch_options, release_dependents, wait_for_previous_kernel


@triton.jit
def _order_keys(x, idx, valid, V, KEY32: tl.constexpr):
    """Keys whose ascending order is x's ascending order, the higher index first among equal values (so the
    lower index ranks higher), and padding lowest. KEY32 (logits widened from bfloat16: the low 16 bits of
    each float are zero): int32 keys, a 16-bit value and a 16-bit index, cheaper to sort than int64 ones."""
    bits = x.to(tl.int32, bitcast=True)
    # One return, after the constexpr branch: Triton checks every return statement's type.
    if KEY32:
        bits = bits >> 16
        monotone = tl.where(bits >= 0, bits, bits ^ 0x7FFF)
        keys = tl.where(valid, (monotone << 16) | (V - 1 - idx), -2147483647 - 1)
    else:
        monotone = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        keys = tl.where(valid, (monotone.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64),
                        -9223372036854775807 - 1)
    return keys


@triton.jit
def _key_values_ids(keys, V, KEY32: tl.constexpr):
    """(float32 values, token ids) of sorted keys (_order_keys' inverse)."""
    if KEY32:
        monotone = keys >> 16
        bits = tl.where(monotone >= 0, monotone, monotone ^ 0x7FFF) << 16
        ids = (V - 1) - (keys & 0xFFFF)
    else:
        monotone = (keys >> 32).to(tl.int32)
        bits = tl.where(monotone >= 0, monotone, monotone ^ 0x7FFFFFFF)
        ids = (V - 1) - (keys & 0xFFFFFFFF).to(tl.int32)
    return bits.to(tl.float32, bitcast=True), ids


@triton.jit
def _race_in_top_k_top_p(x, noise_row_ptr, offs, valid, V, top_p_floor, TOP_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, KEY32: tl.constexpr):
    keys = tl.sort(_order_keys(x, offs, valid, V, KEY32))    # ascending; the top k are the last TOP_K
    kept = offs >= BLOCK_V - TOP_K
    values, ids = _key_values_ids(keys, V, KEY32)
    top = tl.max(tl.where(kept, values, float("-inf")), axis=0)
    weights = tl.where(kept, tl.exp(values - top), 0.0)
    probs = weights / tl.sum(weights, axis=0)
    mass_at_or_below = tl.cumsum(probs, axis=0)
    keep = kept & ((mass_at_or_below > top_p_floor) | (offs == BLOCK_V - 1))
    noise = tl.load(noise_row_ptr + tl.where(keep, ids, 0), mask=keep, other=1.0)
    score = tl.where(keep, probs / noise, -1.0)
    winner = tl.argmax(score, axis=0)
    return tl.sum(tl.where(offs == winner, ids, 0), axis=0)


@triton.jit
def _top_k_race_kernel(logits_ptr, noise_ptr, greedy_ptr, out_ptr, V, stride_l, stride_n, top_p_floor,
                       TOP_K: tl.constexpr, BLOCK_V: tl.constexpr, SAMPLING: tl.constexpr, KEY32: tl.constexpr,
                       PDL: tl.constexpr):
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    greedy = 1
    if SAMPLING:    # an input of the step, not a previous kernel's output: loaded ahead of the wait
        greedy = tl.load(greedy_ptr + row).to(tl.int32)
    wait_for_previous_kernel(PDL)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    code = tl.argmax(x, axis=0, tie_break_left=True)
    if SAMPLING:
        if greedy == 0:
            code = _race_in_top_k_top_p(x, noise_ptr + row * stride_n, offs, valid, V, top_p_floor, TOP_K,
                                        BLOCK_V, KEY32)
    tl.store(out_ptr + row, code.to(tl.int64))


def top_k_race(logits: torch.Tensor, noise: torch.Tensor | None, greedy: torch.Tensor | None, top_k: int,
               top_p_floor: float) -> torch.Tensor:
    """[R] int64 codes from logits [R, V]: the argmax where `greedy` [R] (bool) is set or when `noise` is None,
    else the race with `noise` [R, V] (float32 Exp(1), unit stride along V) over the top `top_k` logits cut to
    the smallest set whose mass exceeds 1 - top_p (`top_p_floor` = 1 - top_p in float32)."""
    rows, vocab = logits.shape
    sampling = noise is not None and greedy is not None
    if logits.stride(-1) != 1 or (sampling and (noise.shape != logits.shape or noise.stride(-1) != 1
                                                 or noise.dtype != torch.float32 or greedy.shape != (rows,))):
        raise ValueError(f"top_k_race needs logits [R, V] and float32 noise [R, V] with unit stride along V and a "
                         f"greedy mask [R]; got {tuple(logits.shape)}, "
                         f"{None if noise is None else (tuple(noise.shape), noise.dtype)}, "
                         f"{None if greedy is None else tuple(greedy.shape)}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = triton.next_power_of_2(vocab)
        _top_k_race_kernel[(rows,)](
            logits, noise if sampling else logits, greedy if sampling else logits, out, vocab, logits.stride(0),
            noise.stride(0) if sampling else 0, top_p_floor, TOP_K=min(top_k, vocab), BLOCK_V=block,
            SAMPLING=sampling, KEY32=logits.dtype == torch.bfloat16 and vocab <= 2**16,
            num_warps=8 if block >= 2048 else 4, **pdl_launch_options(logits))
    return out
