#!/usr/bin/env bash
# The FP8 KV cache (--kv-cache-dtype fp8) on the GPU in one device call.
# Usage (device tool): bash benchmarks/gpu_fp8_kv.sh [SECTION ...]
#   sections: tests attention bench throughput
# $OUT/summary.md gets every table and verdict as it is made; $OUT/all.log every command's full output.
set -u
OUT=${OUT:-/tmp/gpu_fp8_kv}
TOTAL_S=${TOTAL_S:-570}
SUMMARY_PATTERN='^\||passed|failed|Error|PASSED|FAILED|^copy|^matmul'
SUMMARY_LINES=80
CACHE=/tmp/pellucid-bench-models
sections=${*:-tests attention bench throughput}
. "$(dirname "$0")/gpu_common.sh"

for s in $sections; do
  case $s in
    tests) run fp8_kv_tests 240 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_fp8_kv_cache_gpu.py ;;
    attention) run attention_tests 240 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_backend.py \
                 tests/attention/test_triton_norm_rotary.py tests/gpu/test_engine_fused_equal.py ;;
    bench) run fp8_kv_bench 360 python3 benchmarks/fp8_kv_bench.py --kernels --model Llama-3.1-8B --model-cache "$CACHE" \
             --batch-sizes 1,16,64 --context 4096 --output-len 160 ;;
    throughput)   # a KV pool that limits the batch: weights ~16 GB of the 28 GB that 0.2 of an H200 gives
      for kv in auto fp8; do
        run "throughput_$kv" 150 python3 -m pellucid.bench throughput --model Llama-3.1-8B --model-cache "$CACHE" \
          --hf-requests 0 --gpu-memory-utilization 0.2 --kv-cache-dtype $kv
      done ;;
    *) echo "unknown section $s" ;;
  esac
done
