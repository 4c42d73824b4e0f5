"""Engine flags for the CLI, named as vLLM names them, shared by `generate`, `serve`, `bench` and `extract`."""
from __future__ import annotations

import argparse
import json
from typing import Any

from pellucid.config import ALL_REDUCES, KV_CACHE_DTYPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto (checkpoint dtype on GPU, float32 on CPU), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory sizing)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="element type of the KV cache: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2: "
                        "twice the tokens in the same memory, keys and values rounded to 8 bits (scaled by the "
                        "checkpoint's calibrated k/v scales where it has them, else 1.0)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV blocks of shared prompt prefixes (default: on where the model supports it)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps, mixed with decodes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory for weights + KV cache")
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next step before this one is read back, so host work overlaps "
                        "device work (default: on on CUDA, off on the CPU and where the engine core shares "
                        "its process with an asyncio frontend, i.e. --no-engine-process under serve)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine core in its own process (default: yes for `serve`, no for offline "
                        "commands); --no-engine-process keeps it in this process, e.g. to debug it")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many GPUs (processes on the CPU); the engine starts a worker "
                        "process per extra rank, or joins ranks a launcher started (torchrun)")
    g.add_argument("--distributed-executor-backend", choices=("mp", "ray", "env"), default=None,
                   help="mp: worker processes on this machine; ray: a Ray actor per rank on the nodes of the "
                        "Ray cluster (RAY_ADDRESS, else a local one); env: ranks started by torchrun (env:// "
                        "rendezvous, any number of machines). Default: env under torchrun, else mp")
    g.add_argument("--all-reduce", choices=ALL_REDUCES, default="nccl",
                   help="the all-reduce of tensor-parallel layers: nccl (gloo on the CPU), or symm_mem: torch's "
                        "symmetric-memory one-shot kernel for small messages (decode), with the decoder's "
                        "all-reduce + residual add + RMSNorm fused in one kernel, NCCL for the others, NCCL "
                        "throughout (logged) where it cannot run (default: nccl)")
    g.add_argument("--attention-backend", default="auto", help="auto, torch, triton")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's default generator")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs alternatives a request may ask for (-1: the vocabulary)")
    g.add_argument("--head", default="dense",
                   help="LM head: dense, flashhead, none (no LM head: the engine serves embeddings and "
                        "classifications only), or a plugin name")
    g.add_argument("--head-options", type=json.loads, default=None,
                   help='JSON options for the head, e.g. \'{"probes": 256}\'')
    g.add_argument("--hf-overrides", type=json.loads, default=None,
                   help="JSON fields set on the model's config.json as it is read (vLLM's), e.g. '{\"architectures\": "
                        "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                        "\"is_original_qwen3_reranker\": true}' serves Qwen3-Reranker as a cross-encoder")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `LLM(...)` / `EngineConfig.from_kwargs` for parsed CLI flags."""
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_dtype=args.kv_cache_dtype,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling, engine_process=args.engine_process,
                attention_backend=args.attention_backend, seed=args.seed, max_logprobs=args.max_logprobs,
                head=args.head, head_options=args.head_options, tensor_parallel_size=args.tensor_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend, all_reduce=args.all_reduce,
                hf_overrides=args.hf_overrides)
