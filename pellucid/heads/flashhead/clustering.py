"""Balanced spherical k-means over LM-head rows: C clusters of exactly S slots each.

Rows are L2-normalised and compared by cosine similarity. Each iteration assigns tokens to clusters
under a hard capacity of S with a vectorised proposal/accept auction (no Python loop over tokens):
every unassigned token proposes to its most similar cluster that still has room; each cluster keeps its
best proposers up to its remaining room; the rejected propose again. Proposals come from each token's
top-k most similar clusters, so one iteration costs one V x C x H matrix product (done in chunks) plus
a few cheap rounds; tokens whose whole short list filled up are rescored against the open clusters only.

C * S may exceed V: the spare slots become padding (token id -1), which the head masks. Cluster sizes
are bounded so that none can end up empty (cluster_capacities).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pellucid.logger import get_logger

logger = get_logger(__name__)

PAD_TOKEN = -1


@dataclass
class Clustering:
    token_ids: torch.Tensor   # [C, S] int64, token ids per cluster, PAD_TOKEN for padding slots
    centroids: torch.Tensor   # [C, H] float32: mean of the raw (unnormalised) rows of each cluster
    mean_similarity: float    # mean cosine similarity of a token to its cluster's direction


def resolve_shape(vocab_size: int, clusters: int | None, cluster_size: int | None) -> tuple[int, int]:
    """(C, S): C clusters stored in S slots each. Given S (default 16), C = ceil(V / S); given C, any C in
    [1, V], S = ceil(V / C). Both given must agree (C = ceil(V / S))."""
    if clusters is not None and not 1 <= clusters <= vocab_size:
        raise ValueError(f"clusters must be in [1, vocab_size={vocab_size}], got {clusters}")
    if cluster_size is not None and cluster_size < 1:
        raise ValueError(f"cluster_size must be >= 1, got {cluster_size}")
    if cluster_size is None:
        if clusters is not None:
            return clusters, math.ceil(vocab_size / clusters)
        cluster_size = 16
    needed = math.ceil(vocab_size / cluster_size)
    if clusters is not None and clusters != needed:
        raise ValueError(f"{clusters} clusters of {cluster_size} tokens do not fit vocab_size={vocab_size} "
                         f"without empty clusters; use {needed} clusters (ceil(vocab / cluster_size)), or give "
                         f"only the number of clusters")
    return needed, cluster_size


def cluster_capacities(vocab_size: int, clusters: int, cluster_size: int) -> torch.Tensor:
    """How many tokens each cluster may take [C]. When the C * S slots exceed V by fewer than S (always so
    for C = ceil(V / S)), every cluster may fill all S and the assignment decides where the spare slots
    go: no cluster can end up empty. Otherwise (a C chosen freely) the sizes are as even as possible,
    ceil or floor of V / C, summing to V: at most one padding slot per cluster."""
    if clusters * cluster_size - vocab_size < cluster_size:
        return torch.full((clusters,), cluster_size, dtype=torch.int64)
    capacities = torch.full((clusters,), vocab_size // clusters, dtype=torch.int64)
    capacities[:vocab_size % clusters] += 1
    return capacities


def _top_candidates(rows: torch.Tensor, directions: torch.Tensor, k: int, chunk: int,
                    closed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k cosine scores and cluster ids per row, computed in chunks to bound memory."""
    scores_out, ids_out = [], []
    for start in range(0, rows.shape[0], chunk):
        scores = rows[start:start + chunk] @ directions.T
        if closed is not None:
            scores.masked_fill_(closed.unsqueeze(0), float("-inf"))
        top = scores.topk(k, dim=1)
        scores_out.append(top.values)
        ids_out.append(top.indices)
    return torch.cat(scores_out), torch.cat(ids_out)


def _balanced_assign(rows: torch.Tensor, directions: torch.Tensor, capacities: torch.Tensor,
                     shortlist: int, chunk: int) -> torch.Tensor:
    """Cluster id per row such that no cluster receives more rows than its capacity."""
    num_rows, num_clusters = rows.shape[0], directions.shape[0]
    device = rows.device
    k = min(shortlist, num_clusters)
    cand_scores, cand_ids = _top_candidates(rows, directions, k, chunk)
    assignment = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    room = capacities.to(device=device, copy=True)
    pending = torch.arange(num_rows, device=device)
    while pending.numel() > 0:
        scores = cand_scores[pending].masked_fill(room[cand_ids[pending]] <= 0, float("-inf"))
        best = scores.argmax(dim=1)
        best_score = scores.gather(1, best.unsqueeze(1)).squeeze(1)
        exhausted = torch.isinf(best_score)
        if bool(exhausted.any()):
            # Their whole short list is full: rescore those rows against the clusters with room left.
            stuck = pending[exhausted]
            kk = min(k, int((room > 0).sum()))
            new_scores, new_ids = _top_candidates(rows[stuck], directions, kk, chunk, closed=room <= 0)
            cand_scores[stuck, :kk], cand_ids[stuck, :kk] = new_scores, new_ids
            cand_scores[stuck, kk:] = float("-inf")
            continue
        proposal = cand_ids[pending].gather(1, best.unsqueeze(1)).squeeze(1)
        # Rank proposals within each cluster by score (best first): sort by score, then stably by cluster.
        order = best_score.argsort(descending=True)
        order = order[proposal[order].argsort(stable=True)]
        sorted_clusters = proposal[order]
        group_start = torch.searchsorted(sorted_clusters, sorted_clusters, right=False)
        rank = torch.arange(order.numel(), device=device) - group_start
        accepted = order[rank < room[sorted_clusters]]
        winners, winner_clusters = pending[accepted], proposal[accepted]
        assignment[winners] = winner_clusters
        room -= torch.bincount(winner_clusters, minlength=num_clusters)
        keep = torch.ones(pending.numel(), dtype=torch.bool, device=device)
        keep[accepted] = False
        pending = pending[keep]
    return assignment


def _directions(rows: torch.Tensor, assignment: torch.Tensor, num_clusters: int) -> torch.Tensor:
    sums = torch.zeros(num_clusters, rows.shape[1], dtype=rows.dtype, device=rows.device)
    sums.index_add_(0, assignment, rows)
    return torch.nn.functional.normalize(sums, dim=1)


def balanced_spherical_kmeans(weight: torch.Tensor, clusters: int | None = None, cluster_size: int | None = None,
                              iterations: int = 10, seed: int = 0, device: str | torch.device | None = None,
                              shortlist: int = 32, chunk: int = 8192, progress: bool = True) -> Clustering:
    """Cluster the rows of `weight` [V, H]. `device` defaults to CUDA when available (the work is one
    V x C x H product per iteration: seconds on a GPU, minutes on a few CPU cores for a 150k vocabulary)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    vocab_size = weight.shape[0]
    num_clusters, size = resolve_shape(vocab_size, clusters, cluster_size)
    capacities = cluster_capacities(vocab_size, num_clusters, size)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    raw = weight.detach().to(device=device, dtype=torch.float32)
    rows = torch.nn.functional.normalize(raw, dim=1)

    generator = torch.Generator(device="cpu").manual_seed(seed)
    seeds = torch.randperm(vocab_size, generator=generator)[:num_clusters].to(device)
    directions = rows[seeds].clone()
    assignment = torch.empty(0)
    bar = tqdm(range(iterations), desc=f"flashhead k-means C={num_clusters} S={size}", disable=not progress)
    for _ in bar:
        assignment = _balanced_assign(rows, directions, capacities, shortlist, chunk)
        directions = _directions(rows, assignment, num_clusters)
        similarity = float((rows * directions[assignment]).sum(dim=1).mean())
        bar.set_postfix(similarity=f"{similarity:.4f}")
    similarity = float((rows * directions[assignment]).sum(dim=1).mean())

    # Slots: tokens sorted by cluster fill each cluster's first slots; the rest stay padding.
    order = assignment.argsort(stable=True)
    counts = torch.bincount(assignment, minlength=num_clusters)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(vocab_size, device=device) - starts[assignment[order]]
    token_ids = torch.full((num_clusters, size), PAD_TOKEN, dtype=torch.int64, device=device)
    token_ids[assignment[order], slot] = order
    centroids = torch.zeros(num_clusters, raw.shape[1], dtype=torch.float32, device=device)
    centroids.index_add_(0, assignment, raw)
    centroids /= counts.clamp_min(1).unsqueeze(1).to(torch.float32)
    logger.info("flashhead clustering: %d clusters x %d slots for %d tokens, mean cosine to centroid %.4f",
                num_clusters, size, vocab_size, similarity)
    return Clustering(token_ids=token_ids.cpu(), centroids=centroids.cpu(), mean_similarity=similarity)
