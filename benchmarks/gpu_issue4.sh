#!/usr/bin/env bash
# Everything GPU-side of issue 4's runner path in one device call: GPU tests, then benchmarks.
# Usage (device tool): bash benchmarks/gpu_issue4.sh [SECTION ...]   sections: tests qwen merged big throughput fused async step
# $OUT/summary.md gets every table as it is made; $OUT/all.log every command's full output. The whole
# script stops starting sections after TOTAL_S seconds (default 560) so one device call holds it.
set -u
OUT=${OUT:-/tmp/gpu_issue4}
TOTAL_S=${TOTAL_S:-560}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
sections=${*:-tests qwen merged big throughput fused step}
date -u +"date: %Y-%m-%dT%H:%MZ" | tee "$OUT/summary.md"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.md"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/summary.md"

run() {  # run NAME TIMEOUT CMD...: full output to all.log, tables and verdicts to summary.md
  local name=$1 limit=$2; shift 2
  local left=$((TOTAL_S - SECONDS))
  if [ "$left" -lt 20 ]; then echo "-- $name skipped: out of time" | tee -a "$OUT/summary.md"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name: ${PELLUCID_FUSED_KERNELS:+PELLUCID_FUSED_KERNELS=$PELLUCID_FUSED_KERNELS }${PELLUCID_MERGED_PROJ:+PELLUCID_MERGED_PROJ=$PELLUCID_MERGED_PROJ }$*" | tee -a "$OUT/summary.md"
  local t0=$SECONDS
  echo "==== $name" >> "$OUT/all.log"
  timeout "$limit" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?
  cat "/tmp/$name.log" >> "$OUT/all.log"
  grep -E '^\||passed|failed|Error|PASSED|FAILED|agree' "/tmp/$name.log" | tail -40 >> "$OUT/summary.md"
  echo "-- $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.md"
}

for s in $sections; do
  case $s in
    tests) run gpu_tests 200 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu ;;
    qwen) run lat_qwen_graphs 70 python3 -m pellucid.bench latency --model Qwen3-0.6B --batch-sizes 1,8,64,256 --output-len 64 ;;
    big) run lat_llama8b 200 python3 -m pellucid.bench latency --model Llama-3.1-8B --batch-sizes 1,16 --output-len 64 --prefill-len 8192 ;;
    throughput) run throughput_qwen 150 python3 -m pellucid.bench throughput --model Qwen3-0.6B ;;
    fused)
      for k in none rms_norm rotary silu_and_mul; do
        PELLUCID_FUSED_KERNELS=$k run lat_qwen_fused_$k 40 python3 -m pellucid.bench latency --model Qwen3-0.6B --batch-sizes 1,64 --output-len 32
      done
      run lat_qwen_eager 40 python3 -m pellucid.bench latency --model Qwen3-0.6B --batch-sizes 1,64 --output-len 32 --enforce-eager ;;
    merged)
      # Batch-1 decode before / after merged q/k/v + gate/up GEMMs and the add+norm, q/k-norm+rotary kernels
      # (the "before" is the earlier default: separate GEMMs, fused rms_norm, rotary, silu_and_mul only).
      for m in Qwen3-0.6B Llama-3.1-8B; do
        limit=45; [ "$m" = Llama-3.1-8B ] && limit=100
        PELLUCID_MERGED_PROJ=0 PELLUCID_FUSED_KERNELS=rms_norm,rotary,silu_and_mul \
          run lat_${m}_unmerged $limit python3 -m pellucid.bench latency --model $m --batch-sizes 1 --output-len 64
        run lat_${m}_merged $limit python3 -m pellucid.bench latency --model $m --batch-sizes 1 --output-len 64
      done ;;
    async)
      run lat_qwen_async 70 python3 -m pellucid.bench latency --model Qwen3-0.6B --batch-sizes 1,64,256 --output-len 64 --async-scheduling
      run throughput_qwen_async 150 python3 -m pellucid.bench throughput --model Qwen3-0.6B --async-scheduling ;;
    step) run step_overhead 40 python3 benchmarks/step_overhead.py --batch 256 --steps 200 ;;
  esac
done
echo "== summary"; cat "$OUT/summary.md"
