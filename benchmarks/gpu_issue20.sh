#!/usr/bin/env bash
# Everything GPU-side of issue 20 (the Qwen3-Omni speech pipeline) in one device call.
# Usage (device tool): bash benchmarks/gpu_issue20.sh [SECTION ...]
#   sections: tests tests_threads bench bench_eager bench_first bench_threads bench_long bench_full bench_full_processes bench_c1_processes kernels checks profile parts parts_before turns host bench_small
# $OUT/summary.md gets every table and verdict as it is made; $OUT/all.log every command's full output.
set -u
OUT=${OUT:-/tmp/gpu_issue20}
TOTAL_S=${TOTAL_S:-570}
SUMMARY_PATTERN='^\||^device|passed|failed|Error|PASSED|FAILED|pipeline up|replayed| c=|^profile|^    '
SUMMARY_LINES=90
sections=${*:-tests bench}
. "$(dirname "$0")/gpu_common.sh"

for s in $sections; do
  case $s in
    tests) run omni_gpu_tests 220 python3 -m pytest -q -rA -p no:cacheprovider -x tests/gpu/test_omni_gpu.py ;;
    # Qwen3-Omni-30B-A3B shapes (thinker trimmed to fit an H100), async chunk vs stage after stage, CUDA graphs
    # on the thinker, talker and code predictor. 100 frames (8 s of audio). The eager pipeline (2026-11-25,
    # ~150 ms a frame) did not fit both modes in one call; run `bench_eager` for that baseline.
    bench) run omni_bench 560 python3 benchmarks/omni_pipeline_bench.py --concurrency 1,8,32 --text-tokens 200 \
             --talker-frames 100 --stages processes ;;
    bench_eager) run omni_bench_eager 560 python3 benchmarks/omni_pipeline_bench.py --concurrency 1 --text-tokens 200 \
             --talker-frames 100 --enforce-eager --stages processes ;;
    # The TTFP levers. A first chunk of 2 on both edges and a first window of 5 gave TTFP 0.589 s against 0.613
    # (2026-11-25 19:13 UTC, async half only): the talker -> code2wav edge's second chunk (at 27 frames) held the
    # first window back, and the talker waited for the thinker's second chunk (27 tokens). Now the first window
    # sets that edge's first chunk, and steady chunks of 5 keep the talker fed.
    bench_first) run omni_bench_first 560 python3 benchmarks/omni_pipeline_bench.py --concurrency 1,8,32 \
                   --text-tokens 200 --talker-frames 100 --chunk-size 5 --first-chunk-size 1 --first-decode-chunk 5 \
                   --stages processes ;;
    # The same with the three engines in threads of one process, a CUDA stream each (one CUDA context: their
    # kernels run side by side instead of the GPU time-slicing between three processes' contexts).
    tests_threads) run omni_gpu_tests_threads 200 python3 -m pytest -q -rA -p no:cacheprovider -x \
                     tests/gpu/test_omni_gpu.py -k "stage_threads or code_predictor" ;;
    bench_threads) run omni_bench_threads 400 python3 benchmarks/omni_pipeline_bench.py --concurrency 1,8,32 \
                     --text-tokens 200 --talker-frames 100 --chunk-size 5 --first-chunk-size 1 --first-decode-chunk 5 \
                     --stages threads ;;
    # A 200-token answer at the length it takes to say (625 frames, 50 s of audio), one request at a time.
    bench_long) run omni_bench_long 300 python3 benchmarks/omni_pipeline_bench.py --concurrency 1 \
                  --requests-per-level 1 --text-tokens 200 --talker-frames 625 --chunk-size 5 --first-chunk-size 1 \
                  --first-decode-chunk 5 --stages threads ;;
    # The issue's three levels with answers at the length it takes to say them (625 frames, 50 s of audio).
    bench_full) run omni_bench_full 400 python3 benchmarks/omni_pipeline_bench.py --concurrency 1,8,32 \
                  --requests-per-level 1 --text-tokens 200 --talker-frames 625 --chunk-size 5 --first-chunk-size 1 \
                  --first-decode-chunk 5 --stages threads ;;
    # The same with each stage in its own process, as the issue and the server run them.
    bench_full_processes) run omni_bench_full_processes 400 python3 benchmarks/omni_pipeline_bench.py \
                            --concurrency 1,8,32 --requests-per-level 1 --text-tokens 200 --talker-frames 625 \
                            --chunk-size 5 --first-chunk-size 1 --first-decode-chunk 5 --stages processes ;;
    # RTF's spread at concurrency 1: three requests one after the other, async chunk, a process per stage.
    bench_c1_processes) run omni_bench_c1_processes 200 python3 benchmarks/omni_pipeline_bench.py --concurrency 1 \
                          --requests-per-level 3 --text-tokens 200 --talker-frames 625 --chunk-size 5 --first-chunk-size 1 \
                          --first-decode-chunk 5 --stages processes --modes "async chunk" ;;
    kernels) run fused_kernels 120 python3 -m pytest -q -rA -p no:cacheprovider -x tests/gpu/test_fused_kernels.py ;;
    # Where one request's GPU time goes: GPU busy time against wall, per stream (a stage each), each stage's
    # steps, and the top kernels.
    profile) run omni_profile 200 python3 benchmarks/omni_pipeline_bench.py --concurrency 1 --requests-per-level 1 \
               --text-tokens 200 --talker-frames 250 --chunk-size 5 --first-chunk-size 1 --first-decode-chunk 5 \
               --stages threads --modes "async chunk" --profile ;;
    # The per-frame parts alone: the code predictor (graphs and eager) and code2wav windows, kernels per call.
    parts) run omni_parts 150 python3 benchmarks/omni_stage_bench.py ;;
    # The same without the code predictor's one-launch draw and fused K/V store (the tree before them).
    parts_before) PELLUCID_FUSED_KERNELS=$(python3 -c "from pellucid.kernels import KERNELS; \
                    print(','.join(k for k in KERNELS if k not in ('top_k_race', 'rotary_kv_store')))") \
                    run omni_parts_before 150 python3 benchmarks/omni_stage_bench.py ;;
    checks) run kernel_checks 200 python3 tests/gpu/kernel_checks.py cuda ;;
    # Each stage's own step time, with nothing beside it: the three engines in this thread, stepped in turn.
    turns) run omni_turns 200 python3 benchmarks/omni_pipeline_bench.py --concurrency 1 --requests-per-level 1 \
             --text-tokens 200 --talker-frames 100 --chunk-size 5 --first-chunk-size 1 --first-decode-chunk 5 \
             --stages turns --modes "async chunk" ;;
    # Where the host time of each stage's step goes: the `turns` run (every stage in this thread) under cProfile,
    # saved to $OUT/omni_turns.prof and summarised (own time, then cumulative).
    host) run omni_host 200 python3 -m cProfile -o "$OUT/omni_turns.prof" benchmarks/omni_pipeline_bench.py \
            --concurrency 1 --requests-per-level 1 --text-tokens 200 --talker-frames 250 --chunk-size 5 \
            --first-chunk-size 1 --first-decode-chunk 5 --stages turns --modes "async chunk"
          python3 -c "import pstats, sys; p = pstats.Stats(sys.argv[1]); p.sort_stats('tottime').print_stats(45); \
            p.sort_stats('cumulative').print_stats(90)" "$OUT/omni_turns.prof" > "$OUT/omni_host_stats.txt" 2>&1 ;;
    # A quicker pass if the full one runs out of time: fewer frames, two levels.
    bench_small) run omni_bench_small 300 python3 benchmarks/omni_pipeline_bench.py --concurrency 1,8 \
                   --text-tokens 100 --talker-frames 120 --stages threads ;;
    *) echo "unknown section $s" | tee -a "$OUT/summary.md" ;;
  esac
done
