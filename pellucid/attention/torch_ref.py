"""The torch reference attention backend: plain, per-request, float32 math on any device and dtype.

It is the correctness reference for the fast backends, so it favours obviousness over speed: it loops
over requests (bounds read from the host copies of the metadata), gathers each request's keys/values
from the paged cache through its block table, and applies a causal mask by absolute position. That one
code path covers prefill from zero, chunked prefill on a cached prefix, decode, and any mix of them.
"""
from __future__ import annotations

import torch

from pellucid.attention.backend import AttentionBackend, register_backend
from pellucid.attention.metadata import CommonAttentionMetadata


@register_backend("torch")
class TorchReferenceBackend(AttentionBackend):

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat_cache = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
        slots = slot_mapping[: key.shape[0]]
        # Boolean selection is free on the CPU; on a GPU it costs one sync, acceptable for a reference.
        keep = slots >= 0
        slots = slots[keep]
        flat_cache[0].index_copy_(0, slots, key[keep].to(kv_cache.dtype))
        flat_cache[1].index_copy_(0, slots, value[keep].to(kv_cache.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: CommonAttentionMetadata,
                scale: float) -> torch.Tensor:
        output = torch.zeros_like(query)   # padding rows past the last request stay zero
        block_size = kv_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        query_starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        computed = metadata.num_computed_tokens_cpu.tolist()
        for r in range(metadata.num_reqs):
            start, end = query_starts[r], query_starts[r + 1]
            query_len, seq_len = end - start, seq_lens[r]
            if query_len == 0:
                continue
            if computed[r] + query_len != seq_len:
                raise ValueError(f"request {r}: num_computed_tokens ({computed[r]}) + query length ({query_len}) "
                                 f"!= seq_len ({seq_len})")
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_table[r, :num_blocks].to(torch.long)
            keys = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]      # [S, kv_heads, D]
            values = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
            keys = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)    # [H, S, D]
            values = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[start:end].float().transpose(0, 1)                            # [H, Q, D]
            scores = torch.matmul(q, keys.transpose(1, 2)) * scale                  # [H, Q, S]
            query_positions = torch.arange(computed[r], seq_len, device=query.device)
            key_positions = torch.arange(seq_len, device=query.device)
            future = key_positions[None, :] > query_positions[:, None]
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            output[start:end] = torch.matmul(probs, values).transpose(0, 1).to(query.dtype)
        return output
