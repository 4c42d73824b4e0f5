"""Paged-attention kernel times: the "triton" backend vs torch SDPA and vs the physical floor.

Decode: the floor is the KV bytes every step must read, over the device-to-device copy bandwidth
measured in the same run. Prefill: the floor is the attention FLOPs over the bf16 matmul rate measured
in the same run. SDPA runs on contiguous (non-paged) K/V, so it is a dense-kernel yardstick, not a
paged one. Decode times are per layer, from a CUDA graph that runs enough layers (each with its own
cache) to read several times the L2 size, as a model's graph would.

    python benchmarks/attention_bench.py [--tune] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.testing

from pellucid.attention.metadata import CommonAttentionMetadata
from pellucid.attention.triton_backend import TritonAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16   # Llama-3.1-8B attention shape
DTYPE = torch.bfloat16
ELEM = 2


def median_ms(fn, rep: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = median_ms(lambda: a @ b, rep=300)
    return 2 * 8192 ** 3 / (ms * 1e-3)


def paged_metadata(q_lens: list[int], seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> CommonAttentionMetadata:
    """Requests scattered over a shuffled block pool, as a long-running server's cache would be."""
    max_blocks = max(math.ceil(s / BLOCK_SIZE) for s in seq_lens)
    block_table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    block_table = block_table.view(len(seq_lens), max_blocks).to(torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    computed = seq - torch.tensor(q_lens, dtype=torch.int32)
    slots = torch.full((int(qsl[-1]),), -1, dtype=torch.int64)
    return CommonAttentionMetadata(
        num_reqs=len(q_lens), num_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE, query_start_loc=qsl.cuda(), seq_lens=seq.cuda(), num_computed_tokens=computed.cuda(),
        block_table=block_table.cuda(), slot_mapping=slots.cuda(), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        num_computed_tokens_cpu=computed, block_table_cpu=block_table)


def graph_ms_per_call(calls: list, rep: int = 100) -> float:
    """Median time of one call among `calls`, all captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay, rep=rep) / len(calls)


def bench_decode(batch: int, context: int, backend: TritonAttentionBackend, l2_bytes: int, with_sdpa: bool = True):
    gen = torch.Generator().manual_seed(batch * 7 + context)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * ELEM
    layers = max(1, min(32, math.ceil(4 * l2_bytes / kv_bytes)))
    blocks_per_layer = batch * math.ceil(context / BLOCK_SIZE) + 8
    metadata = backend.build_metadata(paged_metadata([1] * batch, [context] * batch, blocks_per_layer, gen))
    caches = [torch.randn(2, blocks_per_layer, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
              for _ in range(layers)]
    query = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    triton_ms = graph_ms_per_call([lambda c=c: backend.forward(query, c, metadata, scale) for c in caches])
    sdpa_ms = float("nan")
    if with_sdpa:
        del caches
        dense = [torch.randn(2, batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(layers)]
        q4 = query.view(batch, HEADS, 1, HEAD_DIM)
        calls = [lambda d=d: F.scaled_dot_product_attention(q4, d[0], d[1], enable_gqa=True) for d in dense]
        try:
            sdpa_ms = graph_ms_per_call(calls)
        except RuntimeError:  # an SDPA kernel that cannot be captured: time it eagerly instead
            torch.cuda.synchronize()
            sdpa_ms = median_ms(lambda: [call() for call in calls]) / len(calls)
    return triton_ms, sdpa_ms, kv_bytes, metadata.num_splits


def bench_prefill(q_lens: list[int], prefixes: list[int], backend: TritonAttentionBackend, with_sdpa: bool = True):
    gen = torch.Generator().manual_seed(sum(q_lens))
    seq_lens = [q + p for q, p in zip(q_lens, prefixes)]
    num_blocks = sum(math.ceil(s / BLOCK_SIZE) for s in seq_lens) + 8
    metadata = backend.build_metadata(paged_metadata(q_lens, seq_lens, num_blocks, gen))
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    triton_ms = median_ms(lambda: backend.forward(query, cache, metadata, scale), rep=300)
    # visible (query, key) pairs under the causal mask, two matmuls of 2 flops per multiply-add
    pairs = sum(q * p + q * (q + 1) / 2 for q, p in zip(q_lens, prefixes))
    flops = 4 * HEADS * HEAD_DIM * pairs
    if not with_sdpa:
        return triton_ms, float("nan"), flops
    dense = []
    for q, s in zip(q_lens, seq_lens):
        qd = torch.randn(1, HEADS, q, HEAD_DIM, device="cuda", dtype=DTYPE)
        kd = torch.randn(1, KV_HEADS, s, HEAD_DIM, device="cuda", dtype=DTYPE)
        vd = torch.randn_like(kd)
        # SDPA's is_causal aligns the mask top-left; with a prefix the mask must be bottom-right, so pass it
        mask = None if q == s else (torch.arange(s, device="cuda")[None, :] <= (s - q + torch.arange(q, device="cuda"))[:, None])
        dense.append((qd, kd, vd, mask))

    def sdpa() -> None:
        for qd, kd, vd, mask in dense:
            F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    sdpa_ms = median_ms(sdpa, rep=300)
    return triton_ms, sdpa_ms, flops


def tune(l2_bytes: int) -> list[str]:
    """Small sweeps of the kernels' block shapes; prints the best of each."""
    lines = []
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, DTYPE, torch.device("cuda"))
    for batch, context in ((1, 2048), (1, 16384), (32, 4096)):
        results = []
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for min_tokens in (128, 256, 512):
                    backend.decode_block_n_small_batch = backend.decode_block_n_large_batch = block_n
                    backend.decode_num_warps = backend.decode_num_warps_small_batch = warps
                    backend.decode_min_tokens_per_split = min_tokens
                    ms, _, _, splits = bench_decode(batch, context, backend, l2_bytes, with_sdpa=False)
                    results.append((ms, block_n, warps, min_tokens, splits))
        results.sort()
        for ms, block_n, warps, min_tokens, splits in results[:3]:
            lines.append(f"tune decode b={batch} ctx={context}: {ms * 1e3:.1f} us block_n={block_n} warps={warps} "
                         f"min_tokens={min_tokens} splits={splits}")
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, DTYPE, torch.device("cuda"))
    results = []
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    backend.prefill_block_m, backend.prefill_block_n = block_m, block_n
                    backend.prefill_num_warps, backend.prefill_num_stages = warps, stages
                    try:
                        ms, _, flops = bench_prefill([8192], [0], backend, with_sdpa=False)
                    except Exception as exc:  # out of shared memory for this shape: not a candidate
                        lines.append(f"tune prefill bm={block_m} bn={block_n} w={warps} s={stages}: {type(exc).__name__}")
                        continue
                    results.append((ms, block_m, block_n, warps, stages, flops / (ms * 1e-3) / 1e12))
    results.sort()
    for ms, block_m, block_n, warps, stages, tflops in results[:4]:
        lines.append(f"tune prefill 8192: {ms * 1e3:.0f} us ({tflops:.0f} TFLOP/s) block_m={block_m} "
                     f"block_n={block_n} warps={warps} stages={stages}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="also sweep block shapes")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    bandwidth = copy_bandwidth()
    rate = matmul_rate()
    header = (f"device: {props.name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; bf16 matmul {rate / 1e12:.0f} TFLOP/s; "
              f"shape: {HEADS} q heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}, bf16")
    rows = []
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, DTYPE, torch.device("cuda"))
    for batch, context in ((1, 1024), (1, 4096), (1, 16384), (1, 65536), (8, 4096), (32, 4096), (64, 8192), (128, 2048)):
        triton_ms, sdpa_ms, kv_bytes, splits = bench_decode(batch, context, backend, l2_bytes)
        floor_ms = kv_bytes / bandwidth * 1e3
        rows.append({"workload": f"decode b={batch} ctx={context} (splits={splits})", "triton_us": triton_ms * 1e3,
                     "sdpa_us": sdpa_ms * 1e3, "floor_us": floor_ms * 1e3, "floor": "KV read"})
    for q_lens, prefixes in (([8192], [0]), ([2048] * 4, [0] * 4), ([2048], [6144]), ([512] * 8, [1536] * 8)):
        triton_ms, sdpa_ms, flops = bench_prefill(q_lens, prefixes, backend)
        rows.append({"workload": f"prefill q={q_lens[0]}x{len(q_lens)} prefix={prefixes[0]}",
                     "triton_us": triton_ms * 1e3, "sdpa_us": sdpa_ms * 1e3, "floor_us": flops / rate * 1e6,
                     "floor": "matmul rate", "triton_tflops": flops / (triton_ms * 1e-3) / 1e12})
    tune_lines = tune(l2_bytes) if args.tune else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, "tune": tune_lines}, f, indent=1)
    for line in tune_lines:
        print(line)
    print(header)
    print(f"{'workload':44} {'triton us':>10} {'sdpa us':>10} {'floor us':>10} {'triton/floor':>13} {'triton/sdpa':>12}  floor")
    for r in rows:
        print(f"{r['workload']:44} {r['triton_us']:10.1f} {r['sdpa_us']:10.1f} {r['floor_us']:10.1f} "
              f"{r['triton_us'] / r['floor_us']:13.2f} {r['triton_us'] / r['sdpa_us']:12.2f}  {r['floor']}")


if __name__ == "__main__":
    main()
