"""The torch reference attention backend: plain, per-request, float32 math on any device and dtype.

It is the correctness reference for the fast backends, so it favours obviousness over speed: it loops
over requests (bounds read from the host copies of the metadata), gathers each request's keys/values
from the paged cache through its block table, and applies a causal mask by absolute position. That one
code path covers prefill from zero, chunked prefill on a cached prefix, decode, and any mix of them.
Single-token (decode) rows are also done together in one padded batch, because a Python loop over
hundreds of decodes dominates CPU generation; the math is the same per row.
"""
from __future__ import annotations

import torch

from pellucid.attention.backend import AttentionBackend, register_backend
from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales, dequantize_kv, quantize_kv
from pellucid.attention.metadata import CommonAttentionMetadata


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@register_backend("torch")
class TorchReferenceBackend(AttentionBackend):

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KvScales = UNIT_KV_SCALES) -> None:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat_cache = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
        slots = slot_mapping[: key.shape[0]]
        # Boolean selection is free on the CPU; on a GPU it costs one sync, acceptable for a reference.
        keep = slots >= 0
        slots = slots[keep]
        # Through a same-sized integer view: index_copy_ has no FP8 kernels on the CPU.
        flat_bits = flat_cache.view(_BITS[kv_cache.element_size()])
        for i, (new, scale) in enumerate(((key, kv_scales.k), (value, kv_scales.v))):
            stored = quantize_kv(new[keep], kv_cache.dtype, scale)
            flat_bits[i].index_copy_(0, slots, stored.view(flat_bits.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: CommonAttentionMetadata,
                scale: float, kv_scales: KvScales = UNIT_KV_SCALES) -> torch.Tensor:
        output = torch.zeros_like(query)   # padding rows past the last request stay zero
        block_size = kv_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        query_starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        computed = metadata.num_computed_tokens_cpu.tolist()
        decodes = [r for r in range(metadata.num_reqs)
                   if query_starts[r + 1] - query_starts[r] == 1 and seq_lens[r] == computed[r] + 1]
        if len(decodes) > 1:
            self._decode_rows(query, kv_cache, metadata, scale, kv_scales, decodes, output)
        batched = set(decodes) if len(decodes) > 1 else set()
        for r in range(metadata.num_reqs):
            start, end = query_starts[r], query_starts[r + 1]
            query_len, seq_len = end - start, seq_lens[r]
            if query_len == 0 or r in batched:
                continue
            if computed[r] + query_len != seq_len:
                raise ValueError(f"request {r}: num_computed_tokens ({computed[r]}) + query length ({query_len}) "
                                 f"!= seq_len ({seq_len})")
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_table[r, :num_blocks].to(torch.long)
            keys = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]      # [S, kv_heads, D]
            values = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
            keys = dequantize_kv(keys, kv_scales.k).repeat_interleave(group, dim=1).transpose(0, 1)    # [H, S, D]
            values = dequantize_kv(values, kv_scales.v).repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[start:end].float().transpose(0, 1)                            # [H, Q, D]
            scores = torch.matmul(q, keys.transpose(1, 2)) * scale                  # [H, Q, S]
            query_positions = torch.arange(computed[r], seq_len, device=query.device)
            key_positions = torch.arange(seq_len, device=query.device)
            future = key_positions[None, :] > query_positions[:, None]
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            output[start:end] = torch.matmul(probs, values).transpose(0, 1).to(query.dtype)
        return output

    def _decode_rows(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: CommonAttentionMetadata,
                     scale: float, kv_scales: KvScales, requests: list[int], output: torch.Tensor) -> None:
        """Requests with one new token each: gather their keys/values padded to the longest, mask the padding."""
        device, block_size = query.device, kv_cache.shape[2]
        seq_lens = metadata.seq_lens_cpu[requests].to(device=device, dtype=torch.long)
        rows = metadata.query_start_loc_cpu[requests].to(device=device, dtype=torch.long)
        max_len = int(metadata.seq_lens_cpu[requests].max())
        blocks = metadata.block_table[torch.tensor(requests, device=metadata.block_table.device),
                                      : -(-max_len // block_size)].to(device=device, dtype=torch.long)
        keys = dequantize_kv(kv_cache[0][blocks].flatten(1, 2)[:, :max_len], kv_scales.k)   # [B, S, kv_heads, D]
        values = dequantize_kv(kv_cache[1][blocks].flatten(1, 2)[:, :max_len], kv_scales.v)
        group = self.num_heads // self.num_kv_heads
        q = query.index_select(0, rows).float().view(len(requests), self.num_kv_heads, group, -1)
        scores = torch.einsum("bhgd,bshd->bhgs", q, keys) * scale                   # [B, kv_heads, G, S]
        padding = torch.arange(max_len, device=device)[None, :] >= seq_lens[:, None]
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgs,bshd->bhgd", torch.softmax(scores, dim=-1), values)
        output[rows] = out.reshape(len(requests), self.num_heads, -1).to(query.dtype)
