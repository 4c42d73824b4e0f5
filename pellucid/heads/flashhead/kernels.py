"""FlashHead's two stages: Triton kernels for CUDA tensors, torch versions everywhere else.

Stage 1 scores every cluster: keys[r, c] = (hidden[r] . centroid[c]) * scale[r] + noise[r, c], where the
head passes scale = 1 / temperature and Gumbel noise for sampled rows (no scale, no noise for greedy rows)
so one top-p over the keys both ranks clusters (greedy) and draws them without replacement (sampling).
Selection keeps the p largest keys per row with an exact radix select (four 8-bit histogram passes in one
program per row). Stage 2 gathers the rows of the chosen clusters (stored contiguously per cluster,
[C, S, H]) and computes their exact logits; padding slots come back as -inf with token id -1. For greedy
rows stage 2 instead reduces straight to the argmax token (`greedy_tokens`), so no logits are written.

No kernel allocates anything that depends on device values or syncs with the host, so the head can be
captured in a CUDA graph. Shapes: hidden [R, H], centroids [C, H], clusters [R, P] int64.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch versions below are used
    triton = None


def triton_available() -> bool:
    return triton is not None


def use_triton(tensor: torch.Tensor) -> bool:
    return triton is not None and tensor.is_cuda


# ----------------------------------------------------------------------------------------------- torch

def stage1_torch(hidden: torch.Tensor, centroids: torch.Tensor, scale: torch.Tensor | None,
                 noise: torch.Tensor | None) -> torch.Tensor:
    keys = (hidden.to(centroids.dtype) @ centroids.T).float()
    if scale is not None:
        keys = keys * scale.unsqueeze(1)
    return keys if noise is None else keys + noise


def stage2_torch(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
                 clusters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, probes = clusters.shape
    size = cluster_weight.shape[1]
    gathered = cluster_weight[clusters]                                   # [R, P, S, H]
    logits = torch.einsum("rpsh,rh->rps", gathered.float(), hidden.float()).reshape(rows, probes * size)
    token_ids = cluster_token_ids[clusters].reshape(rows, probes * size)
    return logits.masked_fill(token_ids < 0, float("-inf")), token_ids


def argmax_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The token of the largest logit per row; ties go to the lowest token id, as a dense argmax does."""
    best = logits.max(dim=1, keepdim=True).values
    return token_ids.masked_fill((logits != best) | (token_ids < 0), torch.iinfo(torch.int64).max).min(dim=1).values


# ---------------------------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _ordered_int32(x):
        """float32 -> int32 in the same order (signed compare): flip the magnitude bits of negatives."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _stage1_kernel(hidden_ptr, centroid_ptr, scale_ptr, noise_ptr, out_ptr, best_ptr, count_ptr,
                       num_rows, num_clusters, hidden_size,
                       stride_hidden, stride_centroid, stride_noise, stride_out,
                       HAS_SCALE: tl.constexpr, HAS_NOISE: tl.constexpr, INIT_GREEDY: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_c = tl.program_id(0)
        pid_r = tl.program_id(1)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_h = tl.arange(0, BLOCK_H)
        mask_r = offs_r < num_rows
        mask_c = offs_c < num_clusters
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            mask_h = (h0 + offs_h) < hidden_size
            x = tl.load(hidden_ptr + offs_r[:, None] * stride_hidden + h0 + offs_h[None, :],
                        mask=mask_r[:, None] & mask_h[None, :], other=0.0)
            w = tl.load(centroid_ptr + offs_c[:, None] * stride_centroid + h0 + offs_h[None, :],
                        mask=mask_c[:, None] & mask_h[None, :], other=0.0)
            x = x.to(w.dtype)
            if UPCAST:  # the Triton CPU interpreter mishandles 16-bit dots; bf16/fp16 are exact in fp32
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
            else:
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        keys = acc
        if HAS_SCALE:
            keys = keys * tl.load(scale_ptr + offs_r, mask=mask_r, other=1.0)[:, None]
        mask = mask_r[:, None] & mask_c[None, :]
        if HAS_NOISE:
            keys += tl.load(noise_ptr + offs_r[:, None] * stride_noise + offs_c[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + offs_r[:, None] * stride_out + offs_c[None, :], keys, mask=mask)
        if INIT_GREEDY:  # reset the rows' argmax accumulators for the greedy stage 2 later on this stream
            first = mask_r & ((offs_r * 0 + pid_c) == 0)   # only the first cluster block writes
            tl.store(best_ptr + offs_r, tl.full((BLOCK_R,), -9223372036854775807 - 1, tl.int64), mask=first)
            tl.store(count_ptr + offs_r, tl.zeros((BLOCK_R,), dtype=tl.int32), mask=first)

    @triton.jit
    def _select_kernel(keys_ptr, out_ptr, num_clusters, stride_keys, stride_out,
                       PROBES: tl.constexpr, BLOCK: tl.constexpr):
        """Indices of the PROBES largest keys of one row (ties: lowest index first), in index order.

        Exact radix select: the keys as order-preserving 32-bit patterns, four passes of one 256-bin
        histogram each over the lanes still matching the digits found so far; each pass fixes the next 8
        bits of the PROBES-th largest key. Then one scan places the keys above it and the first ties.
        """
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < num_clusters
        key = _ordered_int32(tl.load(keys_ptr + row * stride_keys + offs, mask=valid, other=0.0))
        ukey = key ^ (-2147483648)  # sign bit flipped: unsigned bit order == key order
        bins = tl.arange(0, 256)
        need = tl.full((), PROBES, tl.int32)     # how many keys equal to the prefix still to take
        prefix = tl.full((), 0, tl.int32)        # the digits of the PROBES-th largest found so far
        for step in tl.static_range(4):
            shift = 24 - 8 * step   # a compile-time value: static_range unrolls the loop
            digit = (ukey >> shift) & 255
            if step == 0:
                active = valid
            else:
                active = valid & (((ukey ^ prefix) >> (shift + 8)) == 0)
            hist = tl.histogram(digit, 256, mask=active)
            at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            bucket = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
            need -= tl.sum(tl.where(bins > bucket, hist, 0), axis=0)
            prefix = prefix | (bucket << shift)
        threshold = prefix ^ (-2147483648)
        above = valid & (key > threshold)
        tied = valid & (key == threshold)
        # One scan for both running counts: keys above in the low 16 bits, ties in the high bits.
        counts = tl.cumsum(above.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
        tied_rank = counts >> 16
        chosen = above | (tied & (tied_rank <= need))
        position = (counts & 0xFFFF) + tl.minimum(tied_rank, need) - 1
        tl.store(out_ptr + row * stride_out + position, offs.to(tl.int64), mask=chosen)

    @triton.jit
    def _stage2_tile(hidden_ptr, weight_ptr, ids_ptr, clusters_ptr, row, pid_p, num_probes, hidden_size,
                     stride_hidden, stride_clusters, SIZE: tl.constexpr, SIZE_P2: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
        """Stage 2's logits for one tile: one tile row per (probe, slot) pair, BLOCK_P clusters of SIZE
        contiguous weight rows each (slots padded to a power of two for tl.arange, the padding masked off).
        Returns (logits, token ids, probe, slot, mask); slots without a token (id -1) get -inf."""
        offs_t = tl.arange(0, BLOCK_P * SIZE_P2)
        probe = pid_p * BLOCK_P + offs_t // SIZE_P2
        slot = offs_t % SIZE_P2
        mask_t = (probe < num_probes) & (slot < SIZE)
        cluster = tl.load(clusters_ptr + row * stride_clusters + probe, mask=mask_t, other=0)
        weight_row = (cluster * SIZE + slot).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_P * SIZE_P2,), dtype=tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            mask_h = (h0 + offs_h) < hidden_size
            x = tl.load(hidden_ptr + row * stride_hidden + h0 + offs_h, mask=mask_h, other=0.0)
            w = tl.load(weight_ptr + weight_row[:, None] * hidden_size + h0 + offs_h[None, :],
                        mask=mask_t[:, None] & mask_h[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        token = tl.load(ids_ptr + weight_row, mask=mask_t, other=-1)
        logits = tl.where(token >= 0, acc, float("-inf"))
        return logits, token, probe, slot, mask_t

    @triton.jit
    def _stage2_kernel(hidden_ptr, weight_ptr, ids_ptr, clusters_ptr, logits_ptr, token_ids_ptr,
                       num_probes, hidden_size, stride_hidden, stride_clusters, stride_out,
                       SIZE: tl.constexpr, SIZE_P2: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0)
        pid_p = tl.program_id(1)
        logits, token, probe, slot, mask_t = _stage2_tile(
            hidden_ptr, weight_ptr, ids_ptr, clusters_ptr, row, pid_p, num_probes, hidden_size, stride_hidden,
            stride_clusters, SIZE, SIZE_P2, BLOCK_P, BLOCK_H)
        out = row * stride_out + probe * SIZE + slot
        tl.store(logits_ptr + out, logits, mask=mask_t)
        tl.store(token_ids_ptr + out, token, mask=mask_t)

    @triton.jit
    def _stage2_greedy_kernel(hidden_ptr, weight_ptr, ids_ptr, clusters_ptr, best_ptr, count_ptr, tokens_ptr,
                              num_probes, hidden_size, stride_hidden, stride_clusters, programs_per_row,
                              SIZE: tl.constexpr, SIZE_P2: tl.constexpr, BLOCK_P: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        """Stage 2 reduced to the argmax token: each program folds its best (logit, token) into the row's
        accumulator with one 64-bit atomic max (ordered logit bits high, 2^31-1-token low, so ties go to
        the lowest token id); the row's last program to finish decodes the token. best/count were reset
        by stage 1 (or by the caller) earlier on the same stream."""
        row = tl.program_id(0)
        pid_p = tl.program_id(1)
        logits, token, probe, slot, mask_t = _stage2_tile(
            hidden_ptr, weight_ptr, ids_ptr, clusters_ptr, row, pid_p, num_probes, hidden_size, stride_hidden,
            stride_clusters, SIZE, SIZE_P2, BLOCK_P, BLOCK_H)
        packed = (_ordered_int32(logits).to(tl.int64) << 32) | (2147483647 - token).to(tl.int64)
        lowest = tl.full((BLOCK_P * SIZE_P2,), -9223372036854775807 - 1, tl.int64)
        local = tl.max(tl.where(mask_t & (token >= 0), packed, lowest), axis=0)
        tl.atomic_max(best_ptr + row, local)
        finished = tl.atomic_add(count_ptr + row, 1)
        if finished == programs_per_row - 1:
            final = tl.atomic_max(best_ptr + row, local)  # a read: every other program has folded in
            tl.store(tokens_ptr + row, 2147483647 - (final & 0xFFFFFFFF))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the FlashHead Triton kernels need the `triton` package (pip install triton)")


def stage1_triton(hidden: torch.Tensor, centroids: torch.Tensor, scale: torch.Tensor | None,
                  noise: torch.Tensor | None, block_c: int = 32, block_h: int = 256,
                  num_warps: int = 4, num_stages: int = 3,
                  state: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Keys [R, C] float32; with `state` (from `greedy_state`) also resets it for the greedy stage 2."""
    _require_triton()
    hidden, centroids = hidden.contiguous(), centroids.contiguous()
    rows, hidden_size = hidden.shape
    num_clusters = centroids.shape[0]
    out = torch.empty(rows, num_clusters, dtype=torch.float32, device=hidden.device)
    block_r = 16  # tl.dot's smallest M; rows past the batch are masked
    # Full float32 products for float32 centroids; the argument is ignored for 16-bit operands.
    precision = "ieee" if centroids.dtype == torch.float32 or _interpreting() else "tf32"
    scale_arg = scale.float().contiguous() if scale is not None else out
    noise_arg = noise.contiguous() if noise is not None else out
    best, count = state if state is not None else (out, out)
    grid = (triton.cdiv(num_clusters, block_c), triton.cdiv(rows, block_r))
    _stage1_kernel[grid](hidden, centroids, scale_arg, noise_arg, out, best, count,
                         rows, num_clusters, hidden_size,
                         hidden.stride(0), centroids.stride(0), noise_arg.stride(0), out.stride(0),
                         HAS_SCALE=scale is not None, HAS_NOISE=noise is not None,
                         INIT_GREEDY=state is not None, BLOCK_R=block_r,
                         BLOCK_C=block_c, BLOCK_H=block_h, PRECISION=precision, UPCAST=_interpreting(),
                         num_warps=num_warps, num_stages=num_stages)
    return out


def _stage2_blocks(rows: int, size: int, hidden_size: int, block_p: int | None,
                   block_h: int | None) -> tuple[int, int]:
    # Measured on an H100 (Qwen3-0.6B / Llama-3.2-1B head shapes, S = 16, 2026-11-23): two clusters per
    # program at every batch; below batch 8 the whole hidden vector (up to 1024) per load, 256 from 8 on.
    size_p2 = triton.next_power_of_2(size)
    if block_p is None:
        block_p = max(1, 32 // size_p2)
    if block_h is None:
        block_h = min(triton.next_power_of_2(hidden_size), 1024 if rows < 8 else 256)
    # tl.arange needs powers of two (the CPU interpreter does not check, the GPU compiler does)
    if block_p & (block_p - 1) or block_h & (block_h - 1):
        raise ValueError(f"stage 2 block_p and block_h must be powers of two, got {block_p}, {block_h}")
    return block_p, block_h


def stage2_triton(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
                  clusters: torch.Tensor, block_p: int | None = None, block_h: int | None = None,
                  num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    _require_triton()
    hidden, cluster_weight = hidden.contiguous(), cluster_weight.contiguous()
    clusters = clusters.contiguous()
    rows, probes = clusters.shape
    num_clusters, size, hidden_size = cluster_weight.shape
    block_p, block_h = _stage2_blocks(rows, size, hidden_size, block_p, block_h)
    logits = torch.empty(rows, probes * size, dtype=torch.float32, device=hidden.device)
    token_ids = torch.empty(rows, probes * size, dtype=torch.int64, device=hidden.device)
    grid = (rows, triton.cdiv(probes, block_p))
    _stage2_kernel[grid](hidden, cluster_weight, cluster_token_ids.contiguous(), clusters, logits, token_ids,
                         probes, hidden_size, hidden.stride(0), clusters.stride(0), logits.stride(0),
                         SIZE=size, SIZE_P2=triton.next_power_of_2(size), BLOCK_P=block_p, BLOCK_H=block_h,
                         num_warps=num_warps)
    return logits, token_ids


MAX_SELECT_BLOCK = 16384  # one program holds a whole row of keys in registers


def greedy_state(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row argmax accumulators for `stage2_greedy_triton`: (packed best int64, finished programs int32).
    Values are set on the device by the select kernel (or `reset_greedy_state`), never read on the host."""
    return (torch.empty(rows, dtype=torch.int64, device=device), torch.empty(rows, dtype=torch.int32, device=device))


def reset_greedy_state(best: torch.Tensor, count: torch.Tensor) -> None:
    best.fill_(torch.iinfo(torch.int64).min)
    count.zero_()


def select_triton(keys: torch.Tensor, probes: int, num_warps: int = 16) -> torch.Tensor:
    """Cluster ids [R, probes] of the largest keys per row, in ascending id order (same set as topk)."""
    _require_triton()
    keys = keys.contiguous()
    rows, num_clusters = keys.shape
    block = max(triton.next_power_of_2(num_clusters), 256)
    if block > MAX_SELECT_BLOCK:
        raise ValueError(f"select_triton handles up to {MAX_SELECT_BLOCK} clusters, got {num_clusters}")
    out = torch.empty(rows, probes, dtype=torch.int64, device=keys.device)
    _select_kernel[(rows,)](keys, out, num_clusters, keys.stride(0), out.stride(0),
                            PROBES=probes, BLOCK=block, num_warps=num_warps)
    return out


def stage2_greedy_triton(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
                         clusters: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                         block_p: int | None = None, block_h: int | None = None,
                         num_warps: int = 4) -> torch.Tensor:
    """Argmax token per row over the probed clusters; `state` must have been reset on this stream."""
    _require_triton()
    hidden, cluster_weight = hidden.contiguous(), cluster_weight.contiguous()
    clusters = clusters.contiguous()
    rows, probes = clusters.shape
    num_clusters, size, hidden_size = cluster_weight.shape
    block_p, block_h = _stage2_blocks(rows, size, hidden_size, block_p, block_h)
    tokens = torch.empty(rows, dtype=torch.int64, device=hidden.device)
    programs = triton.cdiv(probes, block_p)
    best, count = state
    _stage2_greedy_kernel[(rows, programs)](
        hidden, cluster_weight, cluster_token_ids.contiguous(), clusters, best, count, tokens,
        probes, hidden_size, hidden.stride(0), clusters.stride(0), programs,
        SIZE=size, SIZE_P2=triton.next_power_of_2(size), BLOCK_P=block_p, BLOCK_H=block_h, num_warps=num_warps)
    return tokens


# The one-program radix select beats torch.topk up to 8192 clusters but not at 16384 lanes (H100,
# 2026-11-23, p = 256: 26 vs 41 us for C = 8016; 54 vs 41 us for C = 9496), where torch.topk is used.
FAST_SELECT_BLOCK = 8192


def select_top(keys: torch.Tensor, probes: int) -> torch.Tensor:
    """The `probes` highest-scoring cluster ids per row (order unspecified)."""
    if use_triton(keys) and max(triton.next_power_of_2(keys.shape[1]), 256) <= FAST_SELECT_BLOCK:
        return select_triton(keys, probes)
    return keys.topk(probes, dim=1, sorted=False).indices


def stage1(hidden: torch.Tensor, centroids: torch.Tensor, scale: torch.Tensor | None,
           noise: torch.Tensor | None) -> torch.Tensor:
    if use_triton(hidden):
        return stage1_triton(hidden, centroids, scale, noise)
    return stage1_torch(hidden, centroids, scale, noise)


def stage2(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
           clusters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(hidden):
        return stage2_triton(hidden, cluster_weight, cluster_token_ids, clusters)
    return stage2_torch(hidden, cluster_weight, cluster_token_ids, clusters)


def greedy_tokens(hidden: torch.Tensor, centroids: torch.Tensor, cluster_weight: torch.Tensor,
                  cluster_token_ids: torch.Tensor, probes: int, all_clusters: torch.Tensor) -> torch.Tensor:
    """The argmax token per row among the `probes` best-scoring clusters (three launches on CUDA:
    stage 1 (which also resets the argmax accumulators), select, stage 2 fused with the argmax).
    `all_clusters` [1, C] is used when probes == C."""
    rows = hidden.shape[0]
    num_clusters = centroids.shape[0]
    if not use_triton(hidden):
        if probes >= num_clusters:
            clusters = all_clusters.expand(rows, -1)
        else:
            clusters = stage1_torch(hidden, centroids, None, None).topk(probes, dim=1, sorted=False).indices
        return argmax_tokens(*stage2_torch(hidden, cluster_weight, cluster_token_ids, clusters))
    state = greedy_state(rows, hidden.device)
    if probes >= num_clusters:
        reset_greedy_state(*state)
        clusters = all_clusters.expand(rows, -1)
    else:
        clusters = select_top(stage1_triton(hidden, centroids, None, None, state=state), probes)
    return stage2_greedy_triton(hidden, cluster_weight, cluster_token_ids, clusters, state)
