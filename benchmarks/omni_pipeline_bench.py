"""Qwen3-Omni speech pipeline: async chunk against stage after stage, in the same run.

    python benchmarks/omni_pipeline_bench.py                       # GPU: random weights at Qwen3-Omni-30B-A3B shapes
    python benchmarks/omni_pipeline_bench.py --shape tiny --device cpu --concurrency 1,2 --talker-frames 24

The three stages share the device: by default each in a process of its own, chunks through shared memory, as
the issue and the server run them (`--stages threads`: each in a thread of this process on a CUDA stream of
its own; `turns`: stepped in turn by this thread). Every level is first warmed up in each mode with short
answers. For each concurrency, `--requests-per-level` x concurrency requests run with that many in flight: a
chat prompt, a 200-token answer (`--text-tokens`, EOS ignored: random weights), spoken in
`--talker-frames` frames (EOS banned until then; 12.5 frames per second of audio). The default, 625 frames
(50 s), is how long a 200-token answer takes to say: speech runs at about 3-4 text tokens a second, and the
talker takes one thinker row per frame while the text lasts, so it can never speak 200 tokens in fewer than
200 frames. Fewer frames than that (`--talker-frames 100`, as the first runs used) make the text, not the
speech, bound each request's latency. Reported, median over requests:
time to the first text token (TTFT), time to the first audio packet (TTFP), real-time factor (request
latency / audio duration), and output text tokens/s and audio seconds/s over the level's wall time; the
last column is async chunk / stage after stage. Each level's line also gives the largest RTF of its requests.

Shapes: `full` is Qwen3-Omni-30B-A3B-Instruct's (thinker 48 layers, 128 experts, top 8, hidden 2048; talker
20 layers, 128 experts, hidden 1024, 16 codebooks; code2wav 8 layers); bf16 weights about 68 GB, so on a
device under 100 GB `--thinker-layers` trims the thinker (the script says which it ran). Weights are
random, drawn at load (no files). The thinker's and talker's decode steps replay CUDA graphs (the talker's
code predictor its own), unless `--enforce-eager`; after each mode the script prints each stage's graph
steps and head paths, so a table that ran eagerly says so.

Goals (issue 20): TTFP async <= 0.25 x stage-after-stage at concurrency 1; throughput at 32 not below;
RTF < 0.1.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pellucid.pipeline.graph import qwen3_omni_graph  # noqa: E402
from pellucid.pipeline.omni import OmniLLM  # noqa: E402
from pellucid.pipeline.qwen3_omni import AudioRequest  # noqa: E402
from pellucid.sampling_params import SamplingParams  # noqa: E402

# Qwen3-Omni-30B-A3B-Instruct's token ids (the benchmark's word tokenizer covers every id).
IDS = dict(im_start=151644, im_end=151645, user=872, assistant=77091, system=8948,
           tts_pad=151671, tts_bos=151672, tts_eos=151673, audio=151675, image=151655, video=151656,
           audio_start=151669, vision_start=151652)


STAGE_HOMES = {"threads": "in threads of one process, a CUDA stream each", "processes": "one process each",
               "turns": "in this thread, stepped in turn"}


def full_config(thinker_layers: int) -> dict:
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True}
    multimodal = dict(audio_token_id=IDS["audio"], image_token_id=IDS["image"], video_token_id=IDS["video"],
                      audio_start_token_id=IDS["audio_start"])
    return dict(
        thinker_config=dict(text_config=dict(vocab_size=152064, hidden_size=2048, intermediate_size=768,
                                             num_hidden_layers=thinker_layers, num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                             max_position_embeddings=65536, rms_norm_eps=1e-6, rope_parameters=mrope),
                            user_token_id=IDS["user"], vision_start_token_id=IDS["vision_start"], **multimodal),
        talker_config=dict(text_config=dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048,
                                            num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=2,
                                            head_dim=128, moe_intermediate_size=384, shared_expert_intermediate_size=768,
                                            num_experts=128, num_experts_per_tok=6, norm_topk_prob=False,
                                            max_position_embeddings=65536, rms_norm_eps=1e-6,
                                            rope_parameters={**mrope, "mrope_section": [24, 20, 20]}),
                           code_predictor_config=dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072,
                                                      num_hidden_layers=5, num_attention_heads=16,
                                                      num_key_value_heads=8, head_dim=128, num_code_groups=16,
                                                      max_position_embeddings=65536, rms_norm_eps=1e-6),
                           num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=min(24, thinker_layers),
                           codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156,
                           codec_think_eos_id=2157, codec_pad_id=2148, codec_bos_id=2149,
                           speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}, spatial_merge_size=2,
                           vision_start_token_id=IDS["vision_start"], **multimodal),
        code2wav_config=dict(codebook_size=2048, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=16, intermediate_size=3072, sliding_window=72, num_quantizers=16,
                             upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=1536),
        im_start_token_id=IDS["im_start"], im_end_token_id=IDS["im_end"], tts_pad_token_id=IDS["tts_pad"],
        tts_bos_token_id=IDS["tts_bos"], tts_eos_token_id=IDS["tts_eos"], system_token_id=IDS["system"],
        user_token_id=IDS["user"], assistant_token_id=IDS["assistant"])


def build_full(out_dir: str, thinker_layers: int) -> str:
    import transformers

    from pellucid.bench.models import build_word_tokenizer
    from pellucid.models.loader import RANDOM_WEIGHTS_FILE

    os.makedirs(out_dir, exist_ok=True)
    config = transformers.Qwen3OmniMoeConfig(**full_config(thinker_layers))
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(out_dir)
    build_word_tokenizer(out_dir, 152064)
    with open(os.path.join(out_dir, RANDOM_WEIGHTS_FILE), "w") as f:
        json.dump({"seed": 0}, f)
    return out_dir


@functools.lru_cache(maxsize=None)
def _hf_config(model_dir: str):
    from pellucid.models.loader import read_hf_config
    return read_hf_config(model_dir)


def prompt_ids(model_dir: str, rng: torch.Generator, user_words: int) -> list[int]:
    """A one-turn chat prompt in the checkpoint's token ids: <|im_start|>user ... <|im_end|> <|im_start|>assistant.
    (The config is read once, not per request inside the loop that drives the pipeline and times it.)"""
    c = _hf_config(model_dir)
    small = c.thinker_config.text_config.vocab_size < 10000      # the tiny test checkpoint: specials at both ends
    newline = 198 if not small else 30
    words = torch.randint(*((20, 400) if small else (1000, 100000)), (user_words,), generator=rng).tolist()
    return [c.im_start_token_id, c.user_token_id, newline, *words, c.im_end_token_id, newline,
            c.im_start_token_id, c.assistant_token_id, newline]


def run_level(omni: OmniLLM, concurrency: int, num_requests: int, args: argparse.Namespace) -> dict:
    rng = torch.Generator().manual_seed(concurrency)
    text = SamplingParams(temperature=0.7, max_tokens=args.text_tokens, ignore_eos=True, seed=1)
    # The talker's EOS is banned until the frames are there (min_tokens): its EOS code is no codebook entry.
    talker = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_tokens=args.talker_frames + 1,
                            min_tokens=args.talker_frames + 1, seed=2)
    pending = [prompt_ids(args.model_dir, rng, args.prompt_words) for _ in range(num_requests)]
    done, in_flight, counter = [], 0, 0
    start = time.monotonic()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            omni.add_request(f"c{concurrency}-{counter}", pending.pop(), text, AudioRequest("ethan", talker))
            counter += 1
            in_flight += 1
        for out in omni.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            done.append(out)
            in_flight -= 1
    wall = time.monotonic() - start
    med = lambda key: statistics.median(o.metrics[key] for o in done)  # noqa: E731
    return {"ttft": med("time_to_first_token"), "ttfp": med("time_to_first_audio"), "rtf": med("real_time_factor"),
            "rtf_max": max(o.metrics["real_time_factor"] for o in done),
            "text_tps": sum(len(o.token_ids) for o in done) / wall,
            "audio_sps": sum(o.metrics["audio_seconds"] for o in done) / wall, "wall": wall}


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, stop) intervals."""
    busy, end = 0, 0
    for start, stop in sorted(intervals):
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    return busy


def profile_request(omni: OmniLLM, args: argparse.Namespace, top: int = 12) -> None:
    """One request alone under torch.profiler (CUDA kernels only): the wall time, how much of it the GPU was
    busy (the union of kernel intervals; kernels of the stages' streams overlap, and PDL kernels include
    their wait, so the summed kernel time can exceed it), the same per CUDA stream (with threads, a stage
    each), each stage's steps and their mean wall time over the request, and the top kernels by summed time."""
    from torch.profiler import ProfilerActivity, profile

    before = {stage: stats for stage, stats in omni.stats().items() if stats is not None}
    started = time.monotonic()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_level(omni, 1, 1, args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.monotonic() - started
    kernels = [e for e in prof.profiler.kineto_results.events()
               if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
               and "Memcpy" not in e.name() and "Memset" not in e.name()]
    busy = _busy_ns([(k.start_ns(), k.start_ns() + k.duration_ns()) for k in kernels])
    print(f"profile, one request alone: wall {wall:.3f} s, GPU busy {busy / 1e9:.3f} s "
          f"({100 * busy / 1e9 / wall:.0f}%), kernel time {sum(k.duration_ns() for k in kernels) / 1e9:.3f} s", flush=True)
    by_stream: dict = {}
    for k in kernels:
        by_stream.setdefault(k.device_resource_id(), []).append(k)
    for stream, ks in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        names: dict = {}
        for k in ks:
            names[k.name()[:60]] = names.get(k.name()[:60], 0) + k.duration_ns()
        top_name = max(names, key=names.get)
        stream_busy = _busy_ns([(k.start_ns(), k.start_ns() + k.duration_ns()) for k in ks])
        print(f"    stream {stream}: busy {stream_busy / 1e9:.3f} s, {len(ks)} kernels; top: {top_name}", flush=True)
    for stage, stats in omni.stats().items():
        if stage in before:
            steps = stats.num_steps - before[stage].num_steps
            seconds = stats.step_seconds - before[stage].step_seconds
            print(f"    {stage}: {steps} steps, {seconds:.3f} s in steps ({1000 * seconds / max(steps, 1):.2f} ms "
                  f"each)", flush=True)
    by_name: dict = {}
    for k in kernels:
        entry = by_name.setdefault(k.name()[:90], [0, 0])
        entry[0] += 1
        entry[1] += k.duration_ns()
    for name, (n, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {ns / 1e6:9.1f} ms {n:7d}x  {name}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["full", "tiny"], default="full")
    parser.add_argument("--thinker-layers", type=int, default=None,
                        help="thinker decoder layers (default: 48 where it fits, fewer on devices under 100 GB)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-level", type=int, default=2, help="requests per level = this x concurrency")
    parser.add_argument("--text-tokens", type=int, default=200)
    parser.add_argument("--talker-frames", type=int, default=625)
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--chunk-size", type=int, default=25, help="async chunk: rows per chunk on both edges")
    parser.add_argument("--decode-chunk", type=int, default=25, help="code2wav window, frames")
    parser.add_argument("--left-context", type=int, default=25)
    parser.add_argument("--first-chunk-size", type=int, default=None,
                        help="async chunk: thinker rows of the thinker -> talker edge's first chunk (default: --chunk-size)")
    parser.add_argument("--first-decode-chunk", type=int, default=None,
                        help="async chunk: frames of code2wav's first window, and of the talker -> code2wav edge's "
                             "first chunk (default: --decode-chunk and --chunk-size)")
    parser.add_argument("--stages", choices=["threads", "processes", "turns"], default="processes",
                        help="where the three engines run: a process each (the GPU time-slices between their "
                             "contexts); threads of this process, each stepping by itself on a CUDA stream of its "
                             "own (one CUDA context); or this thread, stepped in turn")
    parser.add_argument("--profile", action="store_true",
                        help="after the async-chunk levels, one more request alone under torch.profiler: GPU busy "
                             "time, overall and per CUDA stream, each stage's steps, and the top kernels")
    parser.add_argument("--modes", default="async chunk,stage after stage",
                        help="which of the two modes to run (comma-separated)")
    parser.add_argument("--enforce-eager", action="store_true", help="every stage's steps eagerly (no CUDA graphs)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="thinker and talker batch limit (CUDA graphs are captured up to it)")
    args = parser.parse_args()
    if args.profile and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error("--profile times GPU kernels: it needs --device cuda on a machine with CUDA")

    work = tempfile.mkdtemp(prefix="omni-bench-")
    kwargs: dict = dict(device=args.device, enforce_eager=args.enforce_eager, max_model_len=4096,
                        max_num_seqs=args.max_num_seqs)
    if args.shape == "tiny":
        from pellucid.tiny_omni import build_tiny_omni
        model = build_tiny_omni(work)
        kwargs.update(max_model_len=512, num_kv_blocks=512)
        shape = "tiny random Qwen3-Omni (tests' shapes)"
    else:
        layers = args.thinker_layers
        if layers is None:
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0
            layers = 48 if memory >= 100 else 36
        model = build_full(work, layers)
        kwargs.update(dtype="bfloat16")
        shape = f"Qwen3-Omni-30B-A3B shapes, thinker {layers} of 48 layers, random bf16 weights"
    args.model_dir = model
    levels = [int(c) for c in args.concurrency.split(",")]
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device: {device}; model: {shape}; text {args.text_tokens} tokens, audio {args.talker_frames} frames "
          f"({args.talker_frames / 12.5:.1f} s at the real model's 12.5 frames/s); code2wav windows "
          f"{args.decode_chunk}+{args.left_context}; async chunk {args.chunk_size}, first thinker chunk "
          f"{args.first_chunk_size or args.chunk_size}, first window {args.first_decode_chunk or args.decode_chunk}; stages "
          f"{STAGE_HOMES[args.stages]}", flush=True)
    results: dict[tuple[str, int], dict] = {}
    modes = [m for m in (("async chunk", args.chunk_size), ("stage after stage", "all")) if m[0] in args.modes.split(",")]
    for mode, chunk in modes:
        graph = qwen3_omni_graph(chunk, connector="shm" if args.stages == "processes" else "inproc",
                                 decode_chunk=args.decode_chunk, left_context=args.left_context,
                                 first_chunk_size=args.first_chunk_size, first_decode_chunk=args.first_decode_chunk)
        if args.shape == "full":     # fixed KV pools (stages share the device; no memory profiling)
            graph = graph.with_stage_args("thinker", num_kv_blocks=2048).with_stage_args("talker", num_kv_blocks=4096)
        started = time.monotonic()
        with OmniLLM(model, graph, engine_process=args.stages == "processes", stage_threads=args.stages == "threads",
                     **kwargs) as omni:
            print(f"{mode}: pipeline up in {time.monotonic() - started:.0f} s", flush=True)
            # Warm-up at every level, short answers: each level's prefill and batch shapes compile their Triton
            # kernels (MoE tiles per tokens per expert, ...) and plan their convolutions here, not inside the
            # measured run of whichever mode comes first.
            # 55 frames: a first window, a second one with short context and a steady one (the default windows).
            warm = argparse.Namespace(**{**vars(args), "text_tokens": 16, "talker_frames": 55})
            for c in levels:
                run_level(omni, c, c, warm)
            for c in levels:
                results[(mode, c)] = r = run_level(omni, c, max(1, args.requests_per_level) * c, args)
                print(f"  {mode} c={c}: {r}", flush=True)
            for stage, stats in omni.stats().items():
                if stats is not None:
                    # Mean wall time per step, from the engine's own clock: on a GPU shared by the stages' processes it
                    # includes waiting for the other stages' work.
                    step_ms = 1000 * stats.step_seconds / max(stats.num_steps, 1)
                    print(f"  {mode} {stage}: {stats.num_steps} steps ({step_ms:.2f} ms each), {stats.num_graph_steps} "
                          f"replayed a CUDA graph; head paths {stats.lm_head_usage}", flush=True)
            if args.profile and mode == "async chunk":
                profile_request(omni, args)
        # The next mode's pipeline is built in this process too (stages in threads): free this one's GPU memory first.
        del omni
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if len(modes) < 2:
        return 0
    print()
    print("| concurrency | figure | async chunk | stage after stage | async / stage-after-stage |")
    print("| --- | --- | --- | --- | --- |")
    for c in levels:
        a, s = results[("async chunk", c)], results[("stage after stage", c)]
        for key, label in (("ttft", "TTFT s (p50)"), ("ttfp", "TTFP s (p50)"), ("rtf", "RTF (p50)"),
                           ("text_tps", "text tokens/s"), ("audio_sps", "audio s/s")):
            print(f"| {c} | {label} | {a[key]:.3f} | {s[key]:.3f} | {a[key] / s[key]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
