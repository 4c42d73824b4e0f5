#!/usr/bin/env bash
# Everything GPU-side of issue 19 (mixture-of-experts models) in one device call.
# Usage (device tool): bash benchmarks/gpu_issue19.sh [SECTION ...]
#   sections: diag diag30b checks tests kernels kernels_decode sweep latency throughput fp8tests latency_fp8 sweep_fp8
# $OUT/summary.md gets every table and verdict as it is made; $OUT/all.log every command's full output.
# Sections stop starting after TOTAL_S seconds (default 570) so one device call holds the script.
set -u
OUT=${OUT:-/tmp/gpu_issue19}
TOTAL_S=${TOTAL_S:-570}
SUMMARY_PATTERN='^\||^weights|^prompt|^workload|passed|failed|Error|PASSED|FAILED|checks|^replay|^engine|^query|^seq_lens|^touched'
SUMMARY_LINES=60
CACHE=/tmp/pellucid-bench-models
sections=${*:-checks tests sweep latency}
. "$(dirname "$0")/gpu_common.sh"

for s in $sections; do
  case $s in
    diag) run diag_traced 90 python3 benchmarks/moe_graph_diag.py --traced-first
          run diag_plain 90 python3 benchmarks/moe_graph_diag.py
          PELLUCID_PDL=0 run diag_traced_nopdl 90 python3 benchmarks/moe_graph_diag.py --traced-first ;;
    diag30b) CUDA_LAUNCH_BLOCKING=1 run diag30b_eager 120 python3 benchmarks/moe_graph_diag.py --layers 48 --batch 1 \
               --max-model-len 8209 --output-len 64 --eager-first ;;
    checks) run moe_checks 400 python3 tests/gpu/moe_checks.py cuda routing experts block ;;
    tests) run moe_tests 200 python3 -m pytest -q -rA -p no:cacheprovider -x tests/gpu/test_moe_gpu.py \
             tests/gpu/test_no_sync.py tests/gpu/test_async_scheduling.py ;;
    kernels) run moe_kernels 150 python3 benchmarks/moe_kernel_bench.py ;;
    kernels_decode) run moe_kernels_decode 120 python3 benchmarks/moe_kernel_bench.py --tokens 1,2,4,8 ;;
    sweep) run moe_sweep 240 python3 benchmarks/moe_kernel_bench.py --sweep ;;
    latency) run latency_30b 240 python3 -m pellucid.bench latency --model Qwen3-30B-A3B --model-cache "$CACHE" \
               --batch-sizes 1,64,256 --input-len 128 --output-len 64 --prefill-len 8192 ;;
    fp8tests) run fp8_checks 360 python3 tests/gpu/moe_checks.py cuda fp8
              run fp8_tests 150 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_fp8_experts_gpu.py ;;
    sweep_fp8) run moe_kernels_bf16 90 python3 benchmarks/moe_kernel_bench.py --tokens 1,64,256
               run moe_sweep_fp8 330 python3 benchmarks/moe_kernel_bench.py --fp8 --sweep --tokens 1,64,256 ;;
    latency_fp8) run latency_30b_fp8 240 python3 -m pellucid.bench latency --model Qwen3-30B-A3B-FP8 \
                   --model-cache "$CACHE" --batch-sizes 1,64,256 --input-len 128 --output-len 64 --prefill-len 8192 ;;
    throughput) run throughput_30b 330 python3 -m pellucid.bench throughput --model Qwen3-30B-A3B \
                  --model-cache "$CACHE" --hf-requests 32 --hf-scale 0.25 ;;
    *) echo "unknown section $s" | tee -a "$OUT/summary.md" ;;
  esac
done
