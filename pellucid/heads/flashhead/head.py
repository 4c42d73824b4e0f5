"""FlashHead: two-stage retrieval LM head (Embedl, arXiv 2603.14591), training-free.

Stage 1 scores all C cluster centroids and keeps p probes; stage 2 computes exact logits for the p * S
tokens of those clusters. Greedy rows keep the p best-scoring clusters and take the max over the
candidates. Sampled rows draw p clusters without replacement in proportion to softmax(score / T)
(Gumbel top-p), so every token stays reachable, then the normal sampler applies temperature, min-p,
top-k and top-p over the candidates' exact logits.

Rows whose result depends on the whole vocabulary go through the exact dense `compute_logits` and the
sampler unchanged (see docs/flashhead.md): a row that asks for logprobs, carries a penalty or has banned
tokens (min_tokens). That is decided per row: a row's path never depends on its batch-mates' parameters.
When the fast rows of a step outnumber `max_fast_batch`, the measured size above which the dense head is
faster on this GPU (crossover.py; the rule is logged at startup), the unseeded ones go dense too.

A seeded row's draws are a function of its seed, step and distribution whichever path it takes: the
sampler gives each vocabulary token the same noise whether the logits cover the whole vocabulary or the
candidates only, and the cluster draw uses a stream of its own (runner/sampler.py), so with probes = C
the fast path samples the very token the dense head would.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from pellucid.config import resolve_dtype
from pellucid.distributed.parallel_state import Shard, TensorParallel
from pellucid.heads.base import LMHead
from pellucid.heads.flashhead import kernels
from pellucid.heads.flashhead.crossover import measure_max_fast_batch
from pellucid.heads.flashhead.asset import default_asset_path, load_asset, resolve_asset_path
from pellucid.heads.flashhead.clustering import PAD_TOKEN
from pellucid.logger import get_logger
from pellucid.runner.sampler import HEAD_STREAM, exponential_noise, host_to_device
from pellucid.runner.sampling_metadata import SamplerOutput, SamplingMetadata, merge_sampler_outputs

logger = get_logger(__name__)

OPTIONS = ("asset", "probes", "stage1_dtype", "max_fast_batch")
DEFAULT_PROBES = 256


def rows_needing_dense(sampling: SamplingMetadata, num_rows: int) -> list[int]:
    """Rows whose output depends on full-vocabulary logits (SamplingMetadata.full_vocab_rows). Metadata
    built by hand may leave that unknown: then logprobs or penalties send every row."""
    if sampling.full_vocab_rows is not None:
        return list(sampling.full_vocab_rows)
    if sampling.max_num_logprobs is not None or not sampling.no_penalties:
        return list(range(num_rows))
    banned = {row for row, ids in sampling.banned_token_ids.items() if ids}
    return sorted(banned | set(sampling.logit_bias) | set(sampling.allowed_token_ids) | set(sampling.grammar_rows))


def fast_rows_metadata(sampling: SamplingMetadata, rows: list[int], index: torch.Tensor) -> SamplingMetadata:
    """The metadata of rows that need no full-vocabulary logits: none asks for logprobs, carries a penalty or
    has its logits edited (banned tokens, a bias, an allowed set), so the stages for those are off (the sampler
    refuses them on candidate logits)."""
    return dataclasses.replace(sampling.subset(rows, index), no_penalties=True, prompt_token_ids=None,
                               output_token_ids=None, banned_token_ids={}, logit_bias={}, allowed_token_ids={},
                               grammar_rows=[], grammar_bitmask=None, max_num_logprobs=None, full_vocab_rows=[])


class FlashHead(LMHead):
    """Under tensor parallelism (`vocab_shard`) every rank holds the centroids and, of each cluster, the
    tokens in its vocabulary rows (clusters are padded to the largest such part of any rank). Stage 1 is the
    same on every rank (the clusters a sampled row draws are rank 0's); stage 2 computes the probed
    clusters' logits for the rank's own tokens, and the candidates of all ranks are gathered before the
    argmax or the sampler, so every path sees the same candidates as at one rank."""

    name = "flashhead"
    supports_tensor_parallel = True

    def __init__(self, weight: torch.Tensor, options: dict[str, Any], model_dir: str | None = None,
                 vocab_shard: Shard | None = None) -> None:
        super().__init__(weight, options, model_dir, vocab_shard)
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown flashhead option(s) {unknown}; known: {', '.join(OPTIONS)}")
        asset_path = self.options.get("asset")
        if asset_path is None:
            if model_dir is None:
                raise ValueError("flashhead needs head_options={'asset': PATH} when no model directory is known")
            asset_path = default_asset_path(model_dir)
        self.asset_path = resolve_asset_path(str(asset_path))
        asset = load_asset(self.asset_path, weight if self.tp is None else _GatheredRows(weight, self.vocab_shard, self.tp))
        self.num_clusters, self.cluster_size = asset.num_clusters, asset.cluster_size
        probes = self.options.get("probes", min(DEFAULT_PROBES, self.num_clusters))
        # An integer only: "12", 12.7 or True would otherwise be coerced into some other setting.
        if isinstance(probes, bool) or not isinstance(probes, numbers.Integral) \
                or not 1 <= probes <= self.num_clusters:
            raise ValueError(f"flashhead probes must be an integer in [1, {self.num_clusters}] (the number of "
                             f"clusters), got {probes!r}")
        self.probes = int(probes)
        device = weight.device
        stage1_dtype = self.options.get("stage1_dtype", "auto")
        self.stage1_dtype = weight.dtype if stage1_dtype == "auto" else resolve_dtype(stage1_dtype, "cuda")
        self.centroids = asset.centroids.to(device=device, dtype=self.stage1_dtype).contiguous()
        token_ids = asset.token_ids if self.vocab_shard is None else _rank_part(asset.token_ids, self.vocab_shard)
        self.cluster_token_ids = token_ids.to(device).contiguous()
        # A permuted copy of the head, rows contiguous per cluster, padding rows zero (and masked anyway).
        flat_ids = self.cluster_token_ids.reshape(-1)
        first = self.vocab_shard.start if self.vocab_shard is not None else 0
        rows = weight.detach()[(flat_ids - first).clamp_min(0)]
        rows[flat_ids == PAD_TOKEN] = 0
        self.cluster_weight = rows.reshape(self.num_clusters, self.cluster_token_ids.shape[1], -1).contiguous()
        self._all_clusters = torch.arange(self.num_clusters, device=device).unsqueeze(0)
        self.rows_fast = 0    # rows served by retrieval, for /metrics
        self.rows_dense = 0   # rows routed to exact dense logits (exactness rule or batch crossover)
        self.max_fast_batch = self._resolve_max_fast_batch(self.options.get("max_fast_batch", "auto"))

    def _resolve_max_fast_batch(self, value: Any) -> int | None:
        """None = the fast path at every batch size. "auto" measures the crossover on CUDA; off-GPU the
        torch path has no crossover worth measuring, so every batch takes the fast path."""
        if value is None:
            return None
        if value != "auto":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"flashhead max_fast_batch must be 'auto', null or an integer >= 0, got {value!r}")
            logger.info("flashhead: fast path for batches of up to %d rows, dense above (set by max_fast_batch)",
                        value)
            return value
        if not self.weight.is_cuda:
            logger.info("flashhead: fast path at every batch size (no crossover is measured off-GPU)")
            return None
        limit, table = measure_max_fast_batch(lambda h: self.compute_logits(h).argmax(dim=1), self.greedy,
                                              self.weight.shape[1], self.weight.dtype, self.weight.device,
                                              agree=None if self.tp is None else self._slowest_rank)
        timings = ", ".join(f"b{b}: dense {d:.0f} us / flash {f:.0f} us" for b, d, f in table)
        if limit == 0:
            logger.warning("flashhead: slower than the dense head even at batch 1 on this GPU (%s); every row "
                           "takes the dense path", timings)
        else:
            logger.info("flashhead: fast path for batches of up to %d rows, dense above (measured greedy head "
                        "latency: %s)", limit, timings)
        return limit

    def _slowest_rank(self, dense_us: float, flash_us: float) -> tuple[float, float]:
        """The crossover's times under tensor parallelism: every rank's ladder must stop at the same rung
        (both heads hold collectives), and a step waits for the slowest rank."""
        assert self.tp is not None
        times = self.tp.all_gather_object((dense_us, flash_us))
        return max(d for d, _ in times), max(f for _, f in times)

    # ------------------------------------------------------------------------------------ retrieval

    def candidates(self, hidden: torch.Tensor,
                   sampling: SamplingMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [R, p*S], exact logits [R, p*S] float32) of the probed clusters; padding slots have
        id -1 and logit -inf. Without `sampling` (or for greedy rows) the p best-scoring clusters."""
        num_rows = hidden.shape[0]
        if self.probes >= self.num_clusters:
            clusters = self._all_clusters.expand(num_rows, -1)
        else:
            scale, noise = self._cluster_draw(num_rows, hidden.device, sampling)
            clusters = kernels.select_clusters(hidden, self.centroids, self.probes, scale, noise)
            if self.tp is not None and noise is not None:
                clusters = self.tp.broadcast(clusters.contiguous())   # rank 0's draw (unseeded rows differ)
        logits, token_ids = kernels.stage2(hidden, self.cluster_weight, self.cluster_token_ids, clusters)
        if self.tp is not None:
            columns = Shard(tuple(r * logits.shape[1] for r in range(self.tp.size)), logits.shape[1],
                            self.tp.size * logits.shape[1], self.tp.rank)
            logits = self.tp.gather_shards(logits, columns)
            token_ids = self.tp.gather_shards(token_ids, columns)
        return token_ids, logits

    def _cluster_draw(self, num_rows: int, device: torch.device,
                      sampling: SamplingMetadata | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Scale and noise for stage 1: Gumbel-top-p over score / T draws clusters without replacement
        with probability proportional to softmax(score / T); greedy rows get scale 1 and no noise
        (all-greedy batches: no scale at all)."""
        if sampling is None or sampling.all_greedy:
            return None, None
        temperature = sampling.temperature.float()
        greedy = temperature == 0
        scale = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature.clamp_min(1e-30))
        gumbel = -torch.log(exponential_noise(torch.Size((num_rows, self.num_clusters)), device, sampling.seeds,
                                              HEAD_STREAM))
        if not sampling.all_random:
            gumbel = gumbel.masked_fill(greedy.unsqueeze(1), 0.0)
        return scale, gumbel

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax token per row among the p best-scoring clusters (no logits materialised on CUDA, at one
        rank; under tensor parallelism the ranks' candidate logits are gathered first)."""
        if self.tp is not None:
            token_ids, logits = self.candidates(hidden)
            return kernels.argmax_tokens(logits, token_ids)
        return kernels.greedy_tokens(hidden, self.centroids, self.cluster_weight, self.cluster_token_ids,
                                     self.probes, self._all_clusters)

    # ------------------------------------------------------------------------------------- sampling

    def sample(self, hidden: torch.Tensor, sampling: SamplingMetadata, sampler: Any) -> SamplerOutput:
        """Each row takes the path its own needs choose: a row's tokens never depend on its batch-mates'
        parameters (see docs/flashhead.md)."""
        num_rows = hidden.shape[0]
        dense = set(rows_needing_dense(sampling, num_rows))
        if self.max_fast_batch is not None and num_rows - len(dense) > self.max_fast_batch:
            # Past the measured crossover the dense head is faster, but a seeded row stays on its path:
            # at probes < C the dense head's distribution is another one, and its draws with it.
            dense.update(row for row in range(num_rows) if row not in sampling.seeds)
        if len(dense) == num_rows:
            self.rows_dense += num_rows
            return sampler(self.compute_logits(hidden), sampling)
        if not dense:
            self.rows_fast += num_rows
            return self._sample_fast(hidden, sampling, sampler)
        dense_rows = sorted(dense)
        fast_rows = [row for row in range(num_rows) if row not in dense]
        self.rows_fast += len(fast_rows)
        self.rows_dense += len(dense_rows)
        fast_index = host_to_device(fast_rows, torch.int64, hidden.device)
        dense_index = host_to_device(dense_rows, torch.int64, hidden.device)
        fast_out = self._sample_fast(hidden[fast_index], fast_rows_metadata(sampling, fast_rows, fast_index),
                                     sampler)
        dense_out = sampler(self.compute_logits(hidden[dense_index]), sampling.subset(dense_rows, dense_index))
        return merge_sampler_outputs(num_rows, [(fast_index, fast_out), (dense_index, dense_out)])

    def _sample_fast(self, hidden: torch.Tensor, sampling: SamplingMetadata, sampler: Any) -> SamplerOutput:
        if sampling.all_greedy:
            return SamplerOutput(sampled_token_ids=self.greedy(hidden))
        token_ids, logits = self.candidates(hidden, sampling)
        return sampler(logits, sampling, column_token_ids=token_ids, vocab_size=self.vocab_size)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "clusters": self.num_clusters, "cluster_size": self.cluster_size,
                "probes": self.probes, "stage1_dtype": str(self.stage1_dtype).removeprefix("torch."),
                "max_fast_batch": "all" if self.max_fast_batch is None else self.max_fast_batch,
                "asset": self.asset_path}

    def usage(self) -> dict[str, int]:
        return {"rows_fast": self.rows_fast, "rows_dense": self.rows_dense}


def _rank_part(token_ids: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[C, S'] the clusters' tokens in the rank's vocabulary rows, each cluster's first, padded with -1 to
    S', the largest such part of a cluster on any rank (so every rank's stage 2 has the same shape)."""
    def inside(start: int, count: int) -> torch.Tensor:
        return (token_ids >= start) & (token_ids < start + count)
    total = shard.total
    widest = max(int(inside(s, max(0, min(shard.length, total - s))).sum(dim=1).max()) for s in shard.starts)
    mine = inside(shard.start, shard.num_valid)
    order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices[:, :widest]
    return torch.where(mine.gather(1, order), token_ids.gather(1, order), torch.full_like(order, PAD_TOKEN))


class _GatheredRows:
    """The full LM head as the asset's fingerprint reads it, `rows[start:stop]`, on every rank: each
    rank's rows broadcast by it (start-up only; never more than one chunk of rows at a time)."""

    def __init__(self, weight: torch.Tensor, shard: Shard | None, tp: TensorParallel) -> None:
        assert shard is not None
        self.weight, self.shard, self.tp = weight, shard, tp
        self.shape = (shard.total, weight.shape[1])

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop = index.start or 0, min(index.stop, self.shard.total)
        out = torch.empty(stop - start, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
        for rank in self.shard.owners():
            first = self.shard.starts[rank]
            lo, hi = max(start, first), min(stop, first + self.shard.length, self.shard.total)
            if lo >= hi:
                continue
            part = out[lo - start:hi - start]
            if rank == self.tp.rank:
                part.copy_(self.weight[lo - first:hi - first])
            self.tp.broadcast(part, src=rank)
        return out
