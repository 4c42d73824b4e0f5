"""Diagnostic: a decode graph of a MoE model replayed right after an engine run, as `pellucid bench latency`
does to time 'graph forward ms', on a shallow Qwen3-30B-A3B shape (same layer shapes, fewer layers).

    PYTHONPATH=. python3 benchmarks/moe_graph_diag.py --layers 4 --batch 256 [--traced-first]

Prints the step buffers' host view for the replayed size, then replays with a sync after each replay, so
an illegal access shows at the replay that made it. Exits non-zero on failure.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def main() -> None:
    from pellucid.bench.latency import _run_batch
    from pellucid.bench.models import NAMED_CONFIGS
    from pellucid.bench.moe import measure_experts_touched
    from pellucid.config import EngineConfig
    from pellucid.llm import LLM
    from pellucid.models.loader import RANDOM_WEIGHTS_FILE
    from pellucid.tiny_models import build_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--traced-first", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--eager-first", action="store_true",
                        help="before the graph replays, one eager forward on the same stale inputs (with "
                             "CUDA_LAUNCH_BLOCKING=1 a fault then names its operation)")
    parser.add_argument("--restage", action="store_true",
                        help="copy the replayed size's step inputs again first (pellucid.bench.latency."
                             "restage_for_replay): without it, a run whose last step was smaller leaves that "
                             "size's staging views holding another layout's bytes")
    args = parser.parse_args()
    out = tempfile.mkdtemp()
    config = dict(NAMED_CONFIGS["Qwen3-30B-A3B"], num_hidden_layers=args.layers, torch_dtype="bfloat16",
                  bos_token_id=None, eos_token_id=2, pad_token_id=0)
    build_tokenizer(out, vocab_size=512)
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    json.dump({"seed": 0}, open(os.path.join(out, RANDOM_WEIGHTS_FILE), "w"))
    llm = LLM.from_config(EngineConfig.from_kwargs(out, dtype="bfloat16", max_model_len=args.max_model_len,
                                               max_num_seqs=256, max_num_batched_tokens=8192,
                                               cuda_graph_sizes=sorted({1, 64, 256, args.batch}),
                                               gpu_memory_utilization=0.85 if args.layers > 24 else 0.5))
    core = llm.engine
    if args.traced_first:
        print("touched at 64:", measure_experts_touched(llm, 64, 128, 8, 1))
        torch.cuda.synchronize()
    _run_batch(llm, args.batch, 128, args.output_len, 2)
    torch.cuda.synchronize()
    print("engine run ok; replayed sizes", sorted(core.runner.cuda_graphs.replayed_sizes))
    bufs = core.runner.buffers
    size = args.batch
    print("query_start_loc", bufs.query_start_loc.np[:size + 1][[0, 1, size - 1, size]].tolist(),
          "max", int(bufs.query_start_loc.np[:size + 1].max()))
    print("seq_lens", bufs.seq_lens.np[:size].min(), bufs.seq_lens.np[:size].max(),
          "positions", bufs.positions.np[:size].min(), bufs.positions.np[:size].max(),
          "slots", bufs.slot_mapping.np[:size].min(), bufs.slot_mapping.np[:size].max(),
          "input ids", bufs.input_ids.np[:size].min(), bufs.input_ids.np[:size].max())
    graphs = core.runner.cuda_graphs
    if args.restage:
        from pellucid.bench.latency import restage_for_replay
        restage_for_replay(bufs.staging, size)
        print("restaged the step inputs of size", size)
    if args.eager_first:
        from pellucid.attention.metadata import forward_context
        captured = graphs._graphs[(size, graphs.length_for(size, None))]
        input_ids = bufs.staging.copy(size, size).input_ids      # the host view again (async fed ids become 0)
        with torch.inference_mode(), forward_context(captured.context):
            core.runner.model(input_ids)
        torch.cuda.synchronize()
        print("eager stale forward ok")
    for i in range(3):
        core.runner.cuda_graphs.replay(size)
        torch.cuda.synchronize()
        print("replay", i, "ok")
    for i in range(20):
        core.runner.cuda_graphs.replay(size)
    torch.cuda.synchronize()
    print("20 back-to-back replays ok")
    print("diag passed")


if __name__ == "__main__":
    main()
