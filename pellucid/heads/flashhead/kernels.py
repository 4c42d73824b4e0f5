"""FlashHead's two stages: Triton kernels for CUDA tensors, torch versions everywhere else.

Stage 1 scores every cluster: keys[r, c] = (hidden[r] . centroid[c]) * scale[r] + noise[r, c], where the
head passes scale = 1 / temperature and Gumbel noise for sampled rows (no scale, no noise for greedy rows)
so one top-p over the keys both ranks clusters (greedy) and draws them without replacement (sampling).
Selection keeps the p largest keys per row with an exact radix select: stage 1's many programs histogram
each key's first 12 bits; then every select program (one per 2,048 keys of a row) finds the bucket of the
p-th largest key, lists its keys above that bucket and appends its keys in the bucket to scratch, and
the row's last program concatenates the lists and ranks the bucket's few keys. Stage 2 gathers the rows
of the chosen clusters (stored contiguously per cluster, [C, S, H]) and computes their exact logits;
padding slots come back as -inf with token id -1. For greedy rows stage 2 instead reduces straight to the
argmax token (`greedy_tokens`), so no logits are written.

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

    from pellucid.kernels.argmax import ordered_int32 as _ordered_int32

    @triton.jit
    def _stage1_kernel(hidden_ptr, centroid_ptr, scale_ptr, noise_ptr, out_ptr, best_ptr, count_ptr, hist_ptr,
                       num_rows, num_clusters, hidden_size,
                       stride_hidden, stride_centroid, stride_noise, stride_out,
                       HAS_SCALE: tl.constexpr, HAS_NOISE: tl.constexpr, INIT_GREEDY: tl.constexpr,
                       HISTOGRAM: tl.constexpr, DIGIT_SHIFT: tl.constexpr,
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
        if HISTOGRAM:  # the first digit of the top-p selection, spread over all of stage 1's programs
            _accumulate_histogram(hist_ptr, offs_r, keys, mask, DIGIT_SHIFT)
        if INIT_GREEDY:  # reset the rows' argmax accumulators for the greedy stage 2 later on this stream
            first = mask_r & ((offs_r * 0 + pid_c) == 0)   # only the first cluster block writes
            tl.store(best_ptr + offs_r, tl.full((BLOCK_R,), -9223372036854775807 - 1, tl.int64), mask=first)
            tl.store(count_ptr + offs_r, tl.zeros((BLOCK_R,), dtype=tl.int32), mask=first)

    @triton.jit
    def _ordered_uint32(x):
        """float32 -> int32 bits whose *unsigned* order is the float order (sign bit flipped)."""
        return _ordered_int32(x) ^ (-2147483648)

    @triton.jit
    def _accumulate_histogram(hist_ptr, offs_r, keys, mask, DIGIT_SHIFT: tl.constexpr):
        """Adds each key's top bits (DIGIT_SHIFT..31 of its ordered pattern) to its row's histogram."""
        digit = (_ordered_uint32(keys) >> DIGIT_SHIFT) & ((1 << (32 - DIGIT_SHIFT)) - 1)
        tl.atomic_add(hist_ptr + offs_r[:, None] * (1 << (32 - DIGIT_SHIFT)) + digit, 1, mask=mask, sem="relaxed")

    @triton.jit
    def _histogram_kernel(keys_ptr, hist_ptr, num_rows, num_clusters, stride_keys,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, DIGIT_SHIFT: tl.constexpr):
        offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (offs_r < num_rows)[:, None] & (offs_c < num_clusters)[None, :]
        keys = tl.load(keys_ptr + offs_r[:, None] * stride_keys + offs_c[None, :], mask=mask, other=0.0)
        _accumulate_histogram(hist_ptr, offs_r, keys, mask, DIGIT_SHIFT)

    @triton.jit
    def _radix_step(hist, need, prefix, shift: tl.constexpr):
        """One radix digit of the need-th largest key: from the 256-bin histogram of digit `shift` over the
        keys still matching `prefix`, the digit's bucket joins the prefix and `need` drops by the keys
        in higher buckets (all of which are taken)."""
        bins = tl.arange(0, 256)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        bucket = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > bucket, hist, 0), axis=0)
        return need, prefix | (bucket << shift)

    @triton.jit
    def _place_above_and_ties(out_row_ptr, ids, above, tied, need, above_before, tied_before):
        """Writes the ids of the `above` lanes and of the first `need` `tied` lanes (counting the
        `tied_before` ties of earlier chunks) after `above_before` earlier picks; returns the counts."""
        # One scan for both running counts: picks above in the low 16 bits, ties in the high bits.
        counts = tl.cumsum(above.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
        tied_rank = tied_before + (counts >> 16)
        chosen = above | (tied & (tied_rank <= need))
        position = above_before + (counts & 0xFFFF) + tl.minimum(tied_rank, need) - 1
        tl.store(out_row_ptr + position, ids.to(tl.int64), mask=chosen)
        return above_before + tl.sum(above.to(tl.int32), axis=0), tied_before + tl.sum(tied.to(tl.int32), axis=0)

    @triton.jit
    def _threshold_bucket(hist_row_ptr, PROBES: tl.constexpr, NUM_BINS: tl.constexpr):
        """(bucket of the PROBES-th largest key, keys in higher buckets, keys in the bucket) from the row's
        first-digit histogram; fewer than PROBES keys lie above the bucket, so at least one comes from it."""
        bins = tl.arange(0, NUM_BINS)
        hist = tl.load(hist_row_ptr + bins)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        bucket = tl.max(tl.where(at_or_above >= PROBES, bins, 0), axis=0)
        above = tl.sum(tl.where(bins > bucket, hist, 0), axis=0)
        in_bucket = tl.sum(tl.where(bins == bucket, hist, 0), axis=0)
        return bucket, above, in_bucket

    @triton.jit
    def _select_kernel(keys_ptr, hist_ptr, counters_ptr, lists_ptr, list_counts_ptr, scratch_ptr, out_ptr,
                       num_clusters, stride_keys, stride_out,
                       PROBES: tl.constexpr, SEGMENT: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                       SEGMENTS_P2: tl.constexpr, LIST: tl.constexpr, SMALL: tl.constexpr,
                       RANK_TILE: tl.constexpr, ROW_CHUNK: tl.constexpr, DIGIT_SHIFT: tl.constexpr):
        """Indices of the PROBES largest keys of a row (ties: lowest index first), order unspecified but
        deterministic: the keys above the threshold bucket in index order, then the bucket's picks.

        Exact radix select on order-preserving 32-bit patterns of the keys, spread over the row: stage 1
        histogrammed the keys' top 32 - DIGIT_SHIFT bits, so every program (one per SEGMENT keys) knows
        the bucket holding the PROBES-th largest key. Each writes its keys of higher buckets (all taken)
        to its own list and appends its keys of that bucket (key bits high, 2^31-1-index low: unique,
        larger = taken first) to the row's scratch. The row's last program to finish (a ticket counter)
        concatenates the lists and ranks the bucket's keys by counting; a bucket of more than SMALL keys
        (e.g. many equal keys) takes 8-bit radix passes over the whole row instead: slower, same set.
        counters [rows, 2] (scratch fill, ticket) must be zero at launch."""
        segment = tl.program_id(0)
        row = tl.program_id(1)
        NUM_BINS: tl.constexpr = 1 << (32 - DIGIT_SHIFT)
        keys_row = keys_ptr + row * stride_keys
        offs = segment * SEGMENT + tl.arange(0, SEGMENT)
        valid = offs < num_clusters
        raw = tl.load(keys_row + offs, mask=valid, other=0.0)   # in flight with the histogram's load
        bucket, above_total, in_bucket = _threshold_bucket(hist_ptr + row * NUM_BINS, PROBES, NUM_BINS)
        need = PROBES - above_total   # keys taken from the bucket, >= 1
        digit = (_ordered_uint32(raw) >> DIGIT_SHIFT) & (NUM_BINS - 1)
        higher = valid & (digit > bucket)
        mine = valid & (digit == bucket)
        # One scan for both running counts: higher keys in the low 16 bits, the bucket's in the high.
        counts = tl.cumsum(higher.to(tl.int32) + (mine.to(tl.int32) << 16), axis=0)
        tl.store(lists_ptr + (row * NUM_SEGMENTS + segment) * LIST + (counts & 0xFFFF) - 1, offs, mask=higher)
        tl.store(list_counts_ptr + row * NUM_SEGMENTS + segment, tl.sum(higher.to(tl.int32), axis=0))
        counters_row = counters_ptr + row * 2
        first_slot = tl.atomic_add(counters_row, tl.sum(mine.to(tl.int32), axis=0), sem="relaxed")
        slot = first_slot + (counts >> 16) - 1
        packed = (_ordered_int32(raw).to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
        tl.store(scratch_ptr + row * SMALL + slot, packed, mask=mine & (slot < SMALL))
        tl.debug_barrier()   # every thread's stores precede the ticket's release
        ticket = tl.atomic_add(counters_row + 1, 1, sem="acq_rel")
        if ticket == NUM_SEGMENTS - 1:
            # The last program: every other program's lists and scratch are visible (acquire; loads
            # bypass L1 with .cg all the same). All three loads are issued before any is used, so the
            # finish costs one round trip to L2.
            out_row = out_ptr + row * stride_out
            segments = tl.arange(0, SEGMENTS_P2)
            lane = tl.arange(0, LIST)
            listed = tl.load(list_counts_ptr + row * NUM_SEGMENTS + segments, mask=segments < NUM_SEGMENTS,
                             other=0, cache_modifier=".cg")
            ids = tl.load(lists_ptr + (row * NUM_SEGMENTS + segments[:, None]) * LIST + lane[None, :],
                          mask=(segments < NUM_SEGMENTS)[:, None], other=0, cache_modifier=".cg")
            tile = tl.arange(0, RANK_TILE)
            scratch_row = scratch_ptr + row * SMALL
            first_tile = tl.load(scratch_row + tile, mask=tile < in_bucket, other=-9223372036854775807 - 1,
                                 cache_modifier=".cg")
            start = tl.cumsum(listed, axis=0) - listed
            take = (segments < NUM_SEGMENTS)[:, None] & (lane[None, :] < listed[:, None])
            tl.store(out_row + start[:, None] + lane[None, :], ids.to(tl.int64), mask=take)
            # The bucket: rank = how many of its packed keys are larger; the `need` smallest ranks win.
            if in_bucket <= RANK_TILE:   # the usual case: one tile against itself
                rank = tl.sum((first_tile[None, :] > first_tile[:, None]).to(tl.int32), axis=1)
                index = 2147483647 - (first_tile & 0xFFFFFFFF)
                tl.store(out_row + above_total + rank, index, mask=(tile < in_bucket) & (rank < need))
            elif in_bucket <= SMALL:
                for i0 in range(0, in_bucket, RANK_TILE):
                    present = (i0 + tile) < in_bucket
                    candidate = tl.load(scratch_row + i0 + tile, mask=present, other=0, cache_modifier=".cg")
                    rank = tl.zeros((RANK_TILE,), dtype=tl.int32)
                    for j0 in range(0, in_bucket, RANK_TILE):
                        other = tl.load(scratch_row + j0 + tile, mask=(j0 + tile) < in_bucket,
                                        other=-9223372036854775807 - 1, cache_modifier=".cg")
                        rank += tl.sum((other[None, :] > candidate[:, None]).to(tl.int32), axis=1)
                    index = 2147483647 - (candidate & 0xFFFFFFFF)
                    tl.store(out_row + above_total + rank, index, mask=present & (rank < need))
            else:  # a crowded bucket: 8-bit passes over the whole row, then a scan placing the bucket's picks
                PASSES: tl.constexpr = (DIGIT_SHIFT + 7) // 8
                prefix = bucket << DIGIT_SHIFT
                lanes = tl.arange(0, ROW_CHUNK)
                for row_step in tl.static_range(PASSES):
                    row_shift = 8 * (PASSES - 1 - row_step)
                    row_hist = tl.zeros((256,), dtype=tl.int32)
                    for row_start in range(0, num_clusters, ROW_CHUNK):
                        row_offs = row_start + lanes
                        row_key = _ordered_uint32(tl.load(keys_row + row_offs, mask=row_offs < num_clusters,
                                                          other=0.0))
                        # the bucket's bits (DIGIT_SHIFT up) and the digits found so far (shift + 8 up)
                        row_match = ((row_offs < num_clusters) & (((row_key ^ prefix) >> DIGIT_SHIFT) == 0)
                                     & (((row_key ^ prefix) >> (row_shift + 8)) == 0))
                        row_hist += tl.histogram((row_key >> row_shift) & 255, 256, mask=row_match)
                    need, prefix = _radix_step(row_hist, need, prefix, row_shift)
                threshold = prefix ^ (-2147483648)
                placed = above_total
                tied_seen = tl.full((), 0, tl.int32)
                for place_start in range(0, num_clusters, ROW_CHUNK):
                    place_offs = place_start + lanes
                    place_valid = place_offs < num_clusters
                    place_raw = tl.load(keys_row + place_offs, mask=place_valid, other=0.0)
                    place_key = _ordered_int32(place_raw)
                    in_bucket_lane = ((_ordered_uint32(place_raw) >> DIGIT_SHIFT) & (NUM_BINS - 1)) == bucket
                    placed, tied_seen = _place_above_and_ties(
                        out_row, place_offs, place_valid & in_bucket_lane & (place_key > threshold),
                        place_valid & (place_key == threshold), need, placed, tied_seen)

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
        # issued before the weight loop, so its latency hides behind the weight loads
        token = tl.load(ids_ptr + weight_row, mask=mask_t, other=-1)
        acc = tl.zeros((BLOCK_P * SIZE_P2,), dtype=tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            mask_h = (h0 + offs_h) < hidden_size
            x = tl.load(hidden_ptr + row * stride_hidden + h0 + offs_h, mask=mask_h, other=0.0)
            w = tl.load(weight_ptr + weight_row[:, None] * hidden_size + h0 + offs_h[None, :],
                        mask=mask_t[:, None] & mask_h[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
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


# The top-p selection's first digit: the top 12 bits of a key's ordered pattern (sign, exponent, three
# mantissa bits: eight buckets per octave), histogrammed by stage 1's programs. The bucket of the p-th
# largest key then holds ~100 keys for p = 256 of ~10k (random or Gumbel-noised scores), few enough for
# one program to finish the select on a copy of them.
DIGIT_SHIFT = 20
NUM_BINS = 1 << (32 - DIGIT_SHIFT)
SELECT_SEGMENT = 2048  # keys per select program (8 per thread at 8 warps)
SELECT_SMALL = 512     # the bucket is ranked from scratch when it holds at most this many keys
SELECT_RANK_TILE = 128  # packed keys compared per side in one step of the ranking
SELECT_CHUNK = 8192    # keys per loop step of a crowded bucket's passes over the row


def selection_workspace(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (digit histogram [rows, NUM_BINS], select counters [rows, 2]) int32, one allocation so one
    memset: the histogram for `stage1_triton(histogram=...)`, both for `select_from_histogram_triton`."""
    flat = torch.zeros(rows * (NUM_BINS + 2), dtype=torch.int32, device=device)
    return flat[:rows * NUM_BINS].view(rows, NUM_BINS), flat[rows * NUM_BINS:].view(rows, 2)


def selection_histogram(rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed per-row digit histogram [rows, NUM_BINS] int32 for `stage1_triton(histogram=...)`."""
    return torch.zeros(rows, NUM_BINS, dtype=torch.int32, device=device)


def stage1_triton(hidden: torch.Tensor, centroids: torch.Tensor, scale: torch.Tensor | None,
                  noise: torch.Tensor | None, block_c: int = 32, block_h: int = 256,
                  num_warps: int = 4, num_stages: int = 3,
                  state: tuple[torch.Tensor, torch.Tensor] | None = None,
                  histogram: torch.Tensor | None = None) -> torch.Tensor:
    """Keys [R, C] float32; with `state` (from `greedy_state`) also resets it for the greedy stage 2; with
    `histogram` (zeroed, from `selection_histogram`) also counts the keys' first digits for the select."""
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
                         histogram if histogram is not None else out,
                         rows, num_clusters, hidden_size,
                         hidden.stride(0), centroids.stride(0), noise_arg.stride(0), out.stride(0),
                         HAS_SCALE=scale is not None, HAS_NOISE=noise is not None,
                         INIT_GREEDY=state is not None, HISTOGRAM=histogram is not None,
                         DIGIT_SHIFT=DIGIT_SHIFT, BLOCK_R=block_r,
                         BLOCK_C=block_c, BLOCK_H=block_h, PRECISION=precision, UPCAST=_interpreting(),
                         num_warps=num_warps, num_stages=num_stages)
    return out


def _stage2_blocks(rows: int, size: int, hidden_size: int, block_p: int | None, block_h: int | None,
                   num_warps: int | None) -> tuple[int, int, int]:
    # Measured on an H100 (Qwen3-0.6B / Llama-3.2-1B head shapes, S = 16, 2026-11-23): two clusters per
    # program at every batch; below batch 8 the whole hidden vector (up to 1024) per load, 256 from 8 on.
    # 8 warps below batch 8: at 4 the [32, 1024] tile spills registers (ptxas: 776-byte stack frame).
    size_p2 = triton.next_power_of_2(size)
    if block_p is None:
        block_p = max(1, 32 // size_p2)
    if block_h is None:
        block_h = min(triton.next_power_of_2(hidden_size), 1024 if rows < 8 else 256)
    if num_warps is None:
        num_warps = 8 if rows < 8 else 4
    # tl.arange needs powers of two (the CPU interpreter does not check, the GPU compiler does)
    if block_p & (block_p - 1) or block_h & (block_h - 1):
        raise ValueError(f"stage 2 block_p and block_h must be powers of two, got {block_p}, {block_h}")
    return block_p, block_h, num_warps


def _stage2_inputs(hidden: torch.Tensor, cluster_weight: torch.Tensor, clusters: torch.Tensor,
                   block_p: int | None, block_h: int | None, num_warps: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """The contiguous tensors and the blocks both stage-2 kernels launch with."""
    _require_triton()
    hidden, cluster_weight, clusters = hidden.contiguous(), cluster_weight.contiguous(), clusters.contiguous()
    _, size, hidden_size = cluster_weight.shape
    block_p, block_h, num_warps = _stage2_blocks(clusters.shape[0], size, hidden_size, block_p, block_h,
                                                 num_warps)
    return hidden, cluster_weight, clusters, block_p, block_h, num_warps


def stage2_triton(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
                  clusters: torch.Tensor, block_p: int | None = None, block_h: int | None = None,
                  num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, cluster_weight, clusters, block_p, block_h, num_warps = _stage2_inputs(
        hidden, cluster_weight, clusters, block_p, block_h, num_warps)
    rows, probes = clusters.shape
    size, hidden_size = cluster_weight.shape[1:]
    logits = torch.empty(rows, probes * size, dtype=torch.float32, device=hidden.device)
    token_ids = torch.empty(rows, probes * size, dtype=torch.int64, device=hidden.device)
    grid = (rows, triton.cdiv(probes, block_p))
    _stage2_kernel[grid](hidden, cluster_weight, cluster_token_ids.contiguous(), clusters, logits, token_ids,
                         probes, hidden_size, hidden.stride(0), clusters.stride(0), logits.stride(0),
                         SIZE=size, SIZE_P2=triton.next_power_of_2(size), BLOCK_P=block_p, BLOCK_H=block_h,
                         num_warps=num_warps)
    return logits, token_ids


def greedy_state(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row argmax accumulators for `stage2_greedy_triton`: (packed best int64, finished programs int32).
    Values are set on the device by stage 1 (or `reset_greedy_state`), never read on the host."""
    return (torch.empty(rows, dtype=torch.int64, device=device), torch.empty(rows, dtype=torch.int32, device=device))


def reset_greedy_state(best: torch.Tensor, count: torch.Tensor) -> None:
    best.fill_(torch.iinfo(torch.int64).min)
    count.zero_()


def histogram_triton(keys: torch.Tensor, block_c: int = 256) -> torch.Tensor:
    """The first-digit histogram of precomputed keys (stage 1 builds it on the fly when asked to)."""
    _require_triton()
    keys = keys.contiguous()
    rows, num_clusters = keys.shape
    hist = selection_histogram(rows, keys.device)
    block_r = 4
    grid = (triton.cdiv(num_clusters, block_c), triton.cdiv(rows, block_r))
    _histogram_kernel[grid](keys, hist, rows, num_clusters, keys.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
                            DIGIT_SHIFT=DIGIT_SHIFT)
    return hist


def select_from_histogram_triton(keys: torch.Tensor, histogram: torch.Tensor, probes: int,
                                 num_warps: int = 8, counters: torch.Tensor | None = None,
                                 segment: int = SELECT_SEGMENT) -> torch.Tensor:
    """Cluster ids [R, probes] of the largest keys per row, order unspecified (the same set as topk, ties
    to the lowest ids); `histogram` must count exactly these keys (stage 1 or `histogram_triton`), and
    `counters` ([R, 2] int32, zero; allocated when not given) is the select's own workspace."""
    _require_triton()
    keys = keys.contiguous()
    rows, num_clusters = keys.shape
    if not 1 <= probes < num_clusters:
        raise ValueError(f"select needs 1 <= probes < clusters, got {probes} of {num_clusters}")
    segment = min(segment, max(triton.next_power_of_2(num_clusters), 16))
    num_segments = triton.cdiv(num_clusters, segment)
    # a segment lists fewer than `probes` keys above the bucket, and at most its own size
    list_len = min(segment, triton.next_power_of_2(probes))
    if counters is None:
        counters = torch.zeros(rows, 2, dtype=torch.int32, device=keys.device)
    lists = torch.empty(rows, num_segments, list_len, dtype=torch.int32, device=keys.device)
    list_counts = torch.empty(rows, num_segments, dtype=torch.int32, device=keys.device)
    scratch = torch.empty(rows, SELECT_SMALL, dtype=torch.int64, device=keys.device)
    out = torch.empty(rows, probes, dtype=torch.int64, device=keys.device)
    _select_kernel[(num_segments, rows)](
        keys, histogram, counters, lists, list_counts, scratch, out, num_clusters, keys.stride(0), out.stride(0),
        PROBES=probes, SEGMENT=segment, NUM_SEGMENTS=num_segments,
        SEGMENTS_P2=triton.next_power_of_2(num_segments), LIST=list_len, SMALL=SELECT_SMALL,
        RANK_TILE=SELECT_RANK_TILE, ROW_CHUNK=min(SELECT_CHUNK, max(triton.next_power_of_2(num_clusters), 16)),
        DIGIT_SHIFT=DIGIT_SHIFT, num_warps=num_warps)
    return out


def select_triton(keys: torch.Tensor, probes: int, num_warps: int = 8) -> torch.Tensor:
    """Cluster ids [R, probes] of the largest keys per row, order unspecified (two launches)."""
    return select_from_histogram_triton(keys, histogram_triton(keys), probes, num_warps)


def stage2_greedy_triton(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
                         clusters: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                         block_p: int | None = None, block_h: int | None = None,
                         num_warps: int | None = None) -> torch.Tensor:
    """Argmax token per row over the probed clusters; `state` must have been reset on this stream."""
    hidden, cluster_weight, clusters, block_p, block_h, num_warps = _stage2_inputs(
        hidden, cluster_weight, clusters, block_p, block_h, num_warps)
    rows, probes = clusters.shape
    size, hidden_size = cluster_weight.shape[1:]
    tokens = torch.empty(rows, dtype=torch.int64, device=hidden.device)
    programs = triton.cdiv(probes, block_p)
    best, count = state
    _stage2_greedy_kernel[(rows, programs)](
        hidden, cluster_weight, cluster_token_ids.contiguous(), clusters, best, count, tokens,
        probes, hidden_size, hidden.stride(0), clusters.stride(0), programs,
        SIZE=size, SIZE_P2=triton.next_power_of_2(size), BLOCK_P=block_p, BLOCK_H=block_h, num_warps=num_warps)
    return tokens


def select_top(keys: torch.Tensor, probes: int) -> torch.Tensor:
    """The `probes` highest-scoring cluster ids per row (order unspecified)."""
    if use_triton(keys):
        return select_triton(keys, probes)
    return keys.topk(probes, dim=1, sorted=False).indices


def stage1(hidden: torch.Tensor, centroids: torch.Tensor, scale: torch.Tensor | None,
           noise: torch.Tensor | None) -> torch.Tensor:
    if use_triton(hidden):
        return stage1_triton(hidden, centroids, scale, noise)
    return stage1_torch(hidden, centroids, scale, noise)


def select_clusters(hidden: torch.Tensor, centroids: torch.Tensor, probes: int, scale: torch.Tensor | None,
                    noise: torch.Tensor | None,
                    state: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Stage 1 and the top-p select: cluster ids [R, probes] with the largest keys (order unspecified). On
    CUDA two launches (stage 1 also histograms the keys' first digit, and resets `state` when given)."""
    if not use_triton(hidden):
        return stage1_torch(hidden, centroids, scale, noise).topk(probes, dim=1, sorted=False).indices
    histogram, counters = selection_workspace(hidden.shape[0], hidden.device)
    keys = stage1_triton(hidden, centroids, scale, noise, state=state, histogram=histogram)
    return select_from_histogram_triton(keys, histogram, probes, counters=counters)


def stage2(hidden: torch.Tensor, cluster_weight: torch.Tensor, cluster_token_ids: torch.Tensor,
           clusters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(hidden):
        return stage2_triton(hidden, cluster_weight, cluster_token_ids, clusters)
    return stage2_torch(hidden, cluster_weight, cluster_token_ids, clusters)


def greedy_tokens(hidden: torch.Tensor, centroids: torch.Tensor, cluster_weight: torch.Tensor,
                  cluster_token_ids: torch.Tensor, probes: int, all_clusters: torch.Tensor) -> torch.Tensor:
    """The argmax token per row among the `probes` best-scoring clusters. On CUDA: zero the select
    workspace (histogram and counters, one memset), stage 1 (which also fills the histogram and resets
    the argmax accumulators), select, stage 2 fused with the argmax. `all_clusters` [1, C] is used when
    probes == C."""
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
        clusters = select_clusters(hidden, centroids, probes, None, None, state=state)
    return stage2_greedy_triton(hidden, cluster_weight, cluster_token_ids, clusters, state)
