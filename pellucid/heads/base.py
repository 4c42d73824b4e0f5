"""The LM head interface: every head turns final hidden states into sampled tokens (and logits when exact)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pellucid.distributed.parallel_state import Shard, get_tensor_parallel
from pellucid.models.layers import linear
from pellucid.runner.sampling_metadata import SamplerOutput, SamplingMetadata


class LMHead(ABC):
    """Chosen by `HeadConfig.name`, built by the runner from the model's `lm_head` weight.

    `compute_logits` must be exact (full vocabulary); `sample` may be approximate (FlashHead) but then
    must route the rows that need exact logits (`SamplingMetadata.full_vocab_rows`) through
    `compute_logits`, row by row: a row's path, like its draws, must not depend on its batch-mates. Logits
    over some tokens only go to the sampler with their token ids (`column_token_ids`), and a head's own
    random draws for a seeded row come from `sampler.step_generator(seed, HEAD_STREAM, ...)`, so a seeded
    row's token depends on its seed, step and distribution only.
    """

    name: str = ""
    # Whether the head works on a vocabulary-parallel weight (tensor parallelism: `vocab_shard` given).
    supports_tensor_parallel = False
    # False for a head without logits (heads/none.py): its engine serves requests that discard their tokens only.
    computes_logits = True

    def __init__(self, weight: torch.Tensor, options: dict[str, Any], model_dir: str | None = None,
                 vocab_shard: Shard | None = None) -> None:
        self.weight = weight          # [vocab, hidden], the model's lm_head weight (tied or not)
        self.options = dict(options)
        self.model_dir = model_dir
        # Under tensor parallelism `weight` holds this rank's rows `vocab_shard` of the vocabulary (padded to
        # a multiple of the rank count) and every rank runs the head on the same hidden states.
        self.vocab_shard = vocab_shard
        self.tp = get_tensor_parallel() if vocab_shard is not None else None

    @property
    def vocab_size(self) -> int:
        return self.vocab_shard.total if self.vocab_shard is not None else self.weight.shape[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact full-vocabulary logits, float32, for hidden [R, hidden]."""
        return self.model_dtype_logits(hidden).float()

    def model_dtype_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits before the float32 cast: the same values in the model's dtype (the sampler casts
        only where it computes on them; greedy argmax does not need to)."""
        logits = linear(hidden, self.weight, None)    # decode-sized rows take the skinny GEMM on CUDA
        if self.tp is not None:
            assert self.vocab_shard is not None
            logits = self.tp.gather_shards(logits, self.vocab_shard)    # every rank's vocabulary rows
        return logits

    @abstractmethod
    def sample(self, hidden: torch.Tensor, sampling: SamplingMetadata, sampler: Any) -> SamplerOutput:
        """Sample one token per row of hidden [R, hidden]."""

    def capture_cuda_graphs(self, row_counts: list[int]) -> None:
        """Capture the head's own CUDA graphs for batches of these sampling row counts (the runner's decode
        graph sizes), once the KV cache is allocated. Most heads have none."""

    def describe(self) -> dict[str, Any]:
        """Name and parameters, for the startup log line, /metrics and /v1/models."""
        return {"name": self.name}

    def usage(self) -> dict[str, int]:
        """Counters of rows served by each of the head's paths (e.g. FlashHead's fast vs dense fallback),
        exported by the server's /metrics; empty for heads with one path."""
        return {}
