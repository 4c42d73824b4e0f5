#!/usr/bin/env bash
# Issue 16 (the engine core in its own process) on the GPU in one device call: GPU tests of the engine
# process and the engine paths it drives, then `pellucid bench serve`: the offline engine, the server
# with its engine core in its own process, and the previous in-thread design, on the same requests.
# Usage (device tool): bash benchmarks/gpu_issue16.sh [SECTION ...]   sections: tests serve throughput
# $OUT/summary.md gets every table; $OUT/all.log every command's output.
set -u
OUT=${OUT:-/tmp/gpu_issue16}
TOTAL_S=${TOTAL_S:-570}
SUMMARY_PATTERN='^\||passed|failed|Error|PASSED|FAILED|error'
sections=${*:-tests serve}
. "$(dirname "$0")/gpu_common.sh"
nproc | sed 's/^/host cores: /' | tee -a "$OUT/summary.md"

for s in $sections; do
  case $s in
    tests)
      run gpu_tests 300 python3 -m pytest -v -rs -p no:cacheprovider --durations=10 tests/gpu/test_no_sync.py \
        tests/gpu/test_async_scheduling.py tests/gpu/test_engine_process_gpu.py tests/gpu/test_gpu_engine.py ;;
    serve)
      # The issue's workload: 1,000 requests, prompts 32-1024 tokens, outputs 16-512, greedy, ignore_eos;
      # all at once, then 300 requests at 10, 20 and 40 req/s (Poisson).
      run bench_serve 480 python3 -m pellucid bench serve --model Qwen3-0.6B --num-requests 1000 \
        --rates inf,10,20,40 --rate-requests 300 --variants process,thread ;;
    serial)   # the engine process stepping serially (is stepping ahead faster there?)
      run bench_serve_serial 200 python3 -m pellucid bench serve --model Qwen3-0.6B --num-requests 1000 \
        --rates inf,20 --rate-requests 300 --variants process --no-offline --server-args=--no-async-scheduling ;;
    throughput) run throughput_qwen 150 python3 -m pellucid.bench throughput --model Qwen3-0.6B ;;
  esac
done
echo "== done in $SECONDS s" | tee -a "$OUT/summary.md"
