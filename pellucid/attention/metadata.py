"""The one attention metadata struct every backend reads, plus the per-step forward context."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass
class CommonAttentionMetadata:
    """Built on the CPU from persistent host buffers; on CUDA its device tensors are views of one staging
    region filled by one copy per step (pellucid/runner/staging.py).

    Token rows are the flat batch layout: request r owns rows query_start_loc[r]:query_start_loc[r+1].
    The `*_cpu` tensors are host copies for backends that plan on the host (no device-to-host reads).
    Rows past `num_tokens` (CUDA-graph padding) have slot_mapping == -1 and must not write the cache.
    """

    num_reqs: int
    num_tokens: int              # real (unpadded) token rows
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor        # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor               # [num_reqs] int32: computed before this step + scheduled now
    num_computed_tokens: torch.Tensor    # [num_reqs] int32: tokens already in the cache before this step
    block_table: torch.Tensor            # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor           # [num_padded_tokens] int64: cache slot for each new token, -1 = skip
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    block_table_cpu: torch.Tensor

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input tensor, valid for one forward pass."""

    attn_metadata: CommonAttentionMetadata
    backend: Any                         # the AttentionBackend instance
    backend_metadata: Any                # what backend.build_metadata returned for this step
    kv_caches: list[torch.Tensor]        # one per attention layer: [2, num_blocks, block_size, kv_heads, head_dim]
    positions: torch.Tensor              # [num_padded_tokens] int64
    token_to_req: torch.Tensor           # [num_padded_tokens] int32: batch index of the request owning each row
    extras: dict[str, Any] = field(default_factory=dict)


# Per thread: engines in threads of one process (a pipeline's stages, ThreadedClient) step concurrently.
_CURRENT = threading.local()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    previous = getattr(_CURRENT, "ctx", None)
    _CURRENT.ctx = ctx
    try:
        yield ctx
    finally:
        _CURRENT.ctx = previous


def get_forward_context() -> ForwardContext:
    ctx = getattr(_CURRENT, "ctx", None)
    if ctx is None:
        raise RuntimeError("model forward called outside pellucid.attention.metadata.forward_context()")
    return ctx
