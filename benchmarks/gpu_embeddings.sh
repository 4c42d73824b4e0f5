#!/usr/bin/env bash
# Embeddings on the GPU in one device call: the GPU tests, then embed_bench.py against transformers.
# Usage (device tool): bash benchmarks/gpu_embeddings.sh [SECTION ...]
#   sections: tests bench bench_short bench_proc bench_short_proc (the last two: the engine core in its own process)
set -u
OUT=${OUT:-/tmp/gpu_embeddings}
TOTAL_S=${TOTAL_S:-570}
SUMMARY_PATTERN='^\||^Qwen|^Llama|^smallest|passed|failed|Error|PASSED|FAILED'
CACHE=/tmp/pellucid-bench-models
sections=${*:-tests bench bench_short}
. "$(dirname "$0")/gpu_common.sh"

for s in $sections; do
  case $s in
    tests) run embed_tests 180 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_embed_gpu.py ;;
    bench) run embed_bench 200 python3 benchmarks/embed_bench.py --model Qwen3-0.6B --model-cache "$CACHE" ;;
    bench_short) run embed_bench_short 150 python3 benchmarks/embed_bench.py --model Qwen3-0.6B \
                   --model-cache "$CACHE" --min-len 8 --max-len 64 --num-inputs 4000 ;;
    bench_proc) run embed_bench_proc 200 python3 benchmarks/embed_bench.py --model Qwen3-0.6B --model-cache "$CACHE" \
                  --engine-process ;;
    bench_short_proc) run embed_bench_short_proc 150 python3 benchmarks/embed_bench.py --model Qwen3-0.6B \
                        --model-cache "$CACHE" --min-len 8 --max-len 64 --num-inputs 4000 --engine-process ;;
    *) echo "unknown section $s" ;;
  esac
done
