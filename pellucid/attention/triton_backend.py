"""The "triton" attention backend: paged attention written in Triton in this project.

Decode-only steps (every request has one query token) run the split-KV decode kernel, whose
split count is picked on the host from the batch shape so that small batches still fill the GPU.
The decode kernel can also apply Qwen3's q/k norm + rotary and store the new K/V itself
(`forward_qk_norm_rotary`, pellucid.attention.norm_rotary). Any step with a prefill or chunked-prefill row runs the unified kernel over all rows (decode rows
included), so a mixed batch is one launch per layer. Both paths read only device tensors and
host-known sizes, so a decode step with a fixed number of requests can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pellucid.attention.backend import AttentionBackend, register_backend
from pellucid.attention.kv_dtype import UNIT_KV_SCALES, KvScales, is_fp8
from pellucid.attention.metadata import CommonAttentionMetadata
from pellucid.attention.norm_rotary import QKNormRotary
from pellucid.attention.triton_kernels import decode_attention, unified_attention, write_kv
from pellucid.logger import get_logger

logger = get_logger(__name__)


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    decode_only: bool
    num_splits: int                       # decode path only; 1 = no reduce kernel
    decode_block_n: int                   # KV tokens per decode loop step
    decode_num_warps: int
    num_covered_rows: int                 # query rows owned by requests (host copy of query_start_loc[-1])
    partial_out: torch.Tensor | None      # [num_reqs, heads, num_splits, head_dim] float32 split workspace
    partial_lse: torch.Tensor | None      # [num_reqs, heads, num_splits] float32


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    # Graph-safe (see module docstring). The runner builds the metadata once per captured graph, with
    # max_seq_len one of decode_graph_lengths, and replays it; build_metadata's split workspaces live with
    # the graph.
    supports_cuda_graphs = True
    kv_write_is_plain_store = True      # write_kv is kv_write.py's slot store
    # Tuning knobs, chosen from measurements on an H100 and an H200 (benchmarks/attention_bench.py,
    # fp8_kv_bench.py): wide KV tiles for a few requests (latency-bound), narrower ones otherwise.
    decode_block_n_small_batch: int = 128
    decode_block_n_large_batch: int = 64
    # Under PDL a small batch's split program waits with its first KV tile loaded; 8 warps finish the
    # post-wait work sooner: Qwen3-0.6B batch 1 0.840-0.847 -> 0.832-0.833 ms/step (engine, H100). FP8 tiles
    # load unpipelined (decode.py) and do best with 4 (batch 4 at 4k tokens: 23 against 30 us, H200).
    decode_num_warps_small_batch: int = 8
    decode_num_warps_small_batch_fp8: int = 4
    decode_num_warps: int = 4
    # The small-batch tiles serve at most this many requests (and fewer (request, kv_head) pairs than SMs). From
    # 4 requests on, (64, 4) tiles were as fast or faster for a 16-bit cache: 0.76-0.89x the time at 8-32 requests of
    # 8k tokens; an FP8 cache keeps its wide tiles up to 8 requests (H200, BENCHMARKS.md "FP8 KV cache").
    decode_small_batch_max_reqs: int = 3
    decode_small_batch_max_reqs_fp8: int = 8
    decode_num_stages: int = 2
    decode_max_splits: int = 32
    decode_min_tokens_per_split: int = 128
    decode_programs_per_sm: int = 2

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device, kv_cache_dtype)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"triton attention supports float16, bfloat16 and float32, not {dtype}")
        device = torch.device(device)
        self.quantizes_kv = is_fp8(self.kv_cache_dtype)
        if self.kv_cache_dtype not in (dtype, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"triton attention keeps its KV cache in the model's dtype or FP8, not {self.kv_cache_dtype}")
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if self.kv_cache_dtype == torch.float8_e4m3fn and capability < (8, 9):
                raise ValueError(f"an fp8_e4m3 KV cache needs a GPU of compute capability 8.9 or newer (this one is "
                                 f"{capability[0]}.{capability[1]}); fp8_e5m2 converts on older GPUs too")
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.num_sms = 8  # CPU only under TRITON_INTERPRET=1 (tests); the split count just varies
        wide = head_dim > 128 or dtype == torch.float32
        self.prefill_block_m = 64 if wide else 128
        self.prefill_block_n = 32 if wide else 64
        self.prefill_num_warps = 4 if head_dim <= 64 else 8
        self.prefill_num_stages = 1 if wide else 2
        if self.quantizes_kv:
            # FP8 tiles convert as they are read: the unified kernel does best with one stage (an 8k-token prefill
            # 2.24 against 2.34 ms with two, H200; BENCHMARKS.md, "FP8 KV cache").
            self.prefill_num_stages = 1
        logger.debug("triton attention: heads=%d kv_heads=%d head_dim=%d dtype=%s sms=%d",
                     num_heads, num_kv_heads, head_dim, dtype, self.num_sms)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        decode_only = common.max_query_len <= 1
        num_covered_rows = int(common.query_start_loc_cpu[common.num_reqs])
        num_splits = self._decode_num_splits(common.num_reqs, common.max_seq_len) if decode_only else 1
        partial_out = partial_lse = None
        if num_splits > 1:
            device = common.query_start_loc.device
            partial_out = torch.empty(common.num_reqs, self.num_heads, num_splits, self.head_dim,
                                      dtype=torch.float32, device=device)
            partial_lse = torch.empty(common.num_reqs, self.num_heads, num_splits, dtype=torch.float32,
                                      device=device)
        max_reqs = self.decode_small_batch_max_reqs_fp8 if self.quantizes_kv else self.decode_small_batch_max_reqs
        small_batch = common.num_reqs <= max_reqs and common.num_reqs * self.num_kv_heads < self.num_sms
        block_n = self.decode_block_n_small_batch if small_batch else self.decode_block_n_large_batch
        small_warps = self.decode_num_warps_small_batch_fp8 if self.quantizes_kv else self.decode_num_warps_small_batch
        num_warps = small_warps if small_batch else self.decode_num_warps
        return TritonAttentionMetadata(common, decode_only, num_splits, block_n, num_warps, num_covered_rows,
                                       partial_out, partial_lse)

    def _decode_num_splits(self, num_reqs: int, max_seq_len: int) -> int:
        """Enough programs to fill the GPU, but no split shorter than decode_min_tokens_per_split.

        Any count is correct for any sequence length (boundaries are computed on the device); under
        CUDA graphs the count captured is the one replayed, so capture with max_seq_len set to the
        longest length the graph will serve (decode_graph_lengths).
        """
        programs = max(1, num_reqs * self.num_kv_heads)
        wanted = triton.cdiv(self.decode_programs_per_sm * self.num_sms, programs)
        by_length = triton.cdiv(max(max_seq_len, 1), self.decode_min_tokens_per_split)
        return max(1, min(wanted, by_length, self.decode_max_splits))

    def decode_graph_lengths(self, num_reqs: int, max_model_len: int) -> list[int]:
        """One graph per power-of-two split count below the one max_model_len takes, each for the lengths that
        count covers. Splits past a request's length still launch and leave, and cost: Qwen3-30B-A3B, batch 1,
        200-token contexts, 2.469 ms/step with 2 splits captured, 2.536 with 8, 2.557 with 32 (H200,
        BENCHMARKS.md issue 19 round 8). With one split there is no reduce kernel either."""
        # Each length is shorter than max_model_len: s < longest <= cdiv(max_model_len, decode_min_tokens_per_split).
        longest = self._decode_num_splits(num_reqs, max_model_len)
        lengths = []
        splits = 1
        while splits < longest:
            lengths.append(splits * self.decode_min_tokens_per_split)
            splits *= 2
        return lengths + [max_model_len]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KvScales = UNIT_KV_SCALES) -> None:
        write_kv(key, value, kv_cache, slot_mapping, kv_scales)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata,
                scale: float, kv_scales: KvScales = UNIT_KV_SCALES) -> torch.Tensor:
        return self._attend(query, kv_cache, metadata, scale, None, kv_scales)

    def fuses_qk_norm_rotary(self, metadata: TritonAttentionMetadata) -> bool:
        # The split-KV decode kernel norms and rotates its heads and stores the new K/V itself, in the model's
        # dtype; the unified kernel (prefill rows) does not. An FP8 cache is written by write_kv alone.
        return isinstance(metadata, TritonAttentionMetadata) and metadata.decode_only and not self.quantizes_kv

    def forward_qk_norm_rotary(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata,
                               scale: float, norm_rotary: QKNormRotary) -> torch.Tensor:
        if not self.fuses_qk_norm_rotary(metadata):
            raise ValueError("the triton backend applies q/k norm + rotary itself only in decode-only steps")
        norm_rotary.check(query)
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != norm_rotary.key.shape[1:]:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not hold keys {tuple(norm_rotary.key.shape[1:])}")
        return self._attend(query, kv_cache, metadata, scale, norm_rotary, UNIT_KV_SCALES)

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata, scale: float,
                norm_rotary: QKNormRotary | None, kv_scales: KvScales) -> torch.Tensor:
        if not isinstance(metadata, TritonAttentionMetadata):
            raise TypeError(f"triton attention got {type(metadata).__name__}; pass what its build_metadata returned")
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(f"query {tuple(query.shape)} is not [T, {self.num_heads}, {self.head_dim}]")
        if kv_cache.dtype not in (query.dtype, self.kv_cache_dtype):
            raise ValueError(f"a KV cache of {kv_cache.dtype} for queries of {query.dtype}: the cache holds the "
                             f"model's dtype or this backend's kv_cache_dtype ({self.kv_cache_dtype})")
        if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
            raise ValueError("triton attention needs the head dimension contiguous in query and kv_cache")
        common = metadata.common
        out = torch.empty_like(query)
        if query.shape[0] > metadata.num_covered_rows:
            out[metadata.num_covered_rows:].zero_()  # padding rows owned by no request: zeros, never garbage
        if common.num_reqs == 0:
            return out
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if metadata.decode_only:
            decode_attention(query, k_cache, v_cache, common.block_table, common.seq_lens, common.query_start_loc,
                             out, scale, metadata.num_splits, metadata.partial_out, metadata.partial_lse,
                             block_n=metadata.decode_block_n, num_warps=metadata.decode_num_warps,
                             num_stages=self.decode_num_stages, norm_rotary=norm_rotary, kv_scales=kv_scales)
        else:
            unified_attention(query, k_cache, v_cache, common.block_table, common.seq_lens, common.query_start_loc,
                              out, scale, block_m=self.prefill_block_m, block_n=self.prefill_block_n,
                              num_warps=self.prefill_num_warps, num_stages=self.prefill_num_stages,
                              kv_scales=kv_scales)
        return out
