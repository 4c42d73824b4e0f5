"""`pellucid flashhead build | eval`. `add_flashhead_parser(subparsers)` only needs an argparse subparsers
object; every subcommand sets `func(args) -> int` as its handler. torch is imported by the handlers, not with
this module, so `--help` answers at once."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Callable

from pellucid.logger import get_logger

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1905, Albert Einstein published four papers that",
    "Ingredients: two cups of flour, one egg, and",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a small village by the sea, there lived",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
]


def read_head_weight(model_dir: str) -> torch.Tensor:
    """The head weight as stored: `lm_head.weight`, or the embeddings when the config ties them."""
    from pellucid.models.loader import read_tensors

    with open(os.path.join(model_dir, "config.json")) as handle:
        config = json.load(handle)
    tied = bool(config.get("tie_word_embeddings", False))
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return read_tensors(model_dir, [name])[name]


def measure_latency_us(fn: Callable[[], object], device: torch.device, repeats: int = 200,
                       warmup: int = 20, cuda_graph: bool = False) -> float:
    """Median microseconds per call: CUDA events on a GPU (optionally replaying a captured graph, which is
    how the engine runs decode steps), wall clock on the CPU."""
    import torch

    from pellucid.heads.flashhead.crossover import capture_cuda_graph

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    call = fn
    if cuda_graph:
        call = capture_cuda_graph(fn).replay
        for _ in range(warmup):
            call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _device(name: str) -> torch.device:
    import torch

    from pellucid.config import resolve_device

    return torch.device(resolve_device(name))


def reports_errors(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose bad arguments or files (ValueError, OSError) print one `error:` line and exit 1."""
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return wrapped


@reports_errors
def run_build(args: argparse.Namespace) -> int:
    from pellucid.heads.flashhead.asset import ASSET_DIRNAME, save_asset
    from pellucid.heads.flashhead.clustering import balanced_spherical_kmeans, resolve_shape

    weight = read_head_weight(args.model)
    resolve_shape(weight.shape[0], args.clusters, args.cluster_size)    # before any work
    device = _device(args.device)
    start = time.perf_counter()
    clustering = balanced_spherical_kmeans(weight, clusters=args.clusters, cluster_size=args.cluster_size,
                                           iterations=args.iterations, seed=args.seed, device=device)
    out = args.out or os.path.join(args.model, ASSET_DIRNAME)
    path = save_asset(out, clustering, weight)
    clusters, size = clustering.token_ids.shape
    print(f"wrote {path}: {clusters} clusters x {size} tokens for vocab {weight.shape[0]}, hidden "
          f"{weight.shape[1]}, mean cosine {clustering.mean_similarity:.4f}, "
          f"{time.perf_counter() - start:.1f} s on {device}")
    return 0


def _prompt_hidden_states(model_dir: str, prompts: list[str], device: torch.device,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Final (post-norm) hidden states of every prompt position, from transformers' own implementation,
    and the model's head weight."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    states = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            states.append(model(ids, output_hidden_states=True).hidden_states[-1][0])
    return torch.cat(states), model.get_output_embeddings().weight.detach()


@reports_errors
def run_eval(args: argparse.Namespace) -> int:
    import torch

    from pellucid.config import resolve_dtype
    from pellucid.heads.flashhead.head import FlashHead

    device = _device(args.device)
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        with open(args.prompts) as handle:
            prompts = [line.rstrip("\n").replace("\\n", "\n") for line in handle if line.strip()]
    hidden, weight = _prompt_hidden_states(args.model, prompts, device, resolve_dtype(args.dtype, device.type))
    options = {"asset": args.asset} if args.asset else {}
    if args.probes is not None:
        options["probes"] = args.probes
    head = FlashHead(weight, options, args.model)
    with torch.no_grad():
        dense_logits = head.compute_logits(hidden)
        token_ids, logits = head.candidates(hidden)
        flash_top1 = token_ids.gather(1, logits.argmax(dim=1, keepdim=True)).squeeze(1)
        agreement = float((flash_top1 == dense_logits.argmax(dim=1)).float().mean())
        dense_topk = dense_logits.topk(args.top_k, dim=1).indices
        contained = torch.cat([(dense_topk[i:i + 64, :, None] == token_ids[i:i + 64, None, :]).any(dim=2)
                               for i in range(0, hidden.shape[0], 64)])
        containment = float(contained.float().mean())
        one = hidden[:1].contiguous()
        graph = device.type == "cuda"
        dense_us = measure_latency_us(lambda: head.compute_logits(one).argmax(dim=1), device, cuda_graph=graph)
        flash_us = measure_latency_us(lambda: head.greedy(one), device, cuda_graph=graph)
    info = head.describe()
    rows = [("positions evaluated", f"{hidden.shape[0]} ({len(prompts)} prompts)"),
            ("clusters x size, probes", f"{info['clusters']} x {info['cluster_size']}, p={info['probes']}"),
            ("top-1 agreement with dense", f"{agreement:.4f}"),
            (f"top-{args.top_k} containment (dense top-{args.top_k} in candidates)", f"{containment:.4f}"),
            ("dense head latency, batch 1 (us/step)", f"{dense_us:.1f}"),
            ("flashhead latency, batch 1 (us/step)", f"{flash_us:.1f}"),
            ("speedup (dense / flashhead)", f"{dense_us / flash_us:.2f}x")]
    width = max(len(name) for name, _ in rows)
    print(f"FlashHead eval of {args.model} on {device} ({torch.cuda.get_device_name(device) if graph else 'cpu'})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0


def add_flashhead_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pellucid.cli import subcommand_help

    parser = subparsers.add_parser("flashhead", help=subcommand_help("flashhead"))
    commands = parser.add_subparsers(dest="flashhead_command", required=True)

    build = commands.add_parser("build", help="cluster the model's head weights into a FlashHead asset")
    build.add_argument("model", help="HuggingFace-format model directory")
    build.add_argument("--clusters", type=int, default=None,
                       help="number of clusters C, any in [1, V] (sizes as even as possible, at most ceil(V / C)); "
                            "default ceil(V / S)")
    build.add_argument("--cluster-size", type=int, default=None,
                       help="slots per cluster S (default 16; C = ceil(V / S), fewer than S slots padding)")
    build.add_argument("--iterations", type=int, default=10, help="k-means iterations")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", default=None, help="output directory or .safetensors file "
                                                   "(default MODEL/flashhead/, where the head looks first)")
    build.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cpu")
    build.set_defaults(func=run_build)

    evaluate = commands.add_parser("eval", help="compare FlashHead with the dense head on prompts")
    evaluate.add_argument("model", help="HuggingFace-format model directory")
    evaluate.add_argument("--prompts", default=None, help="file with one prompt per line (\\n for newlines)")
    evaluate.add_argument("--probes", type=int, default=None, help="clusters probed per step (default 256)")
    evaluate.add_argument("--asset", default=None, help="asset path (default MODEL/flashhead/)")
    evaluate.add_argument("--top-k", type=int, default=5, help="k for the top-k containment figure")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--dtype", default="auto")
    evaluate.set_defaults(func=run_eval)
    return parser
