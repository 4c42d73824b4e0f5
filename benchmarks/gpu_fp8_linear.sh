#!/usr/bin/env bash
# FP8 projections (pellucid.models.fp8_linear) on the GPU in one device call.
# Usage (device tool): bash benchmarks/gpu_fp8_linear.sh [SECTION ...]
#   sections: checks tests bench sweep latency
# $OUT/summary.md gets every table and verdict as it is made; $OUT/all.log every command's full output.
set -u
OUT=${OUT:-/tmp/gpu_fp8_linear}
TOTAL_S=${TOTAL_S:-570}
SUMMARY_PATTERN='^\||passed|failed|Error|PASSED|FAILED|checks|^sweep'
SUMMARY_LINES=80
CACHE=/tmp/pellucid-bench-models
sections=${*:-checks tests bench latency}
. "$(dirname "$0")/gpu_common.sh"

for s in $sections; do
  case $s in
    checks) run fp8_linear_checks 240 python3 tests/gpu/fp8_linear_checks.py cuda ;;
    tests) run fp8_linear_tests 300 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_fp8_linear_gpu.py \
             tests/gpu/test_fp8_experts_gpu.py ;;
    bench) run fp8_linear_bench 200 python3 benchmarks/fp8_linear_bench.py ;;
    sweep) run fp8_linear_sweep 300 python3 benchmarks/fp8_linear_bench.py --sweep ;;
    latency)
      for model in Qwen3-30B-A3B-FP8 Llama-3.1-8B-FP8; do
        for keep in 1 0; do
          PELLUCID_FP8_LINEAR=$keep run "latency_${model}_fp8linear$keep" 150 python3 -m pellucid.bench latency \
            --model "$model" --model-cache "$CACHE" --batch-sizes 1,64 --input-len 128 --output-len 64 --prefill-len 8192
        done
      done ;;
    *) echo "unknown section $s" ;;
  esac
done
