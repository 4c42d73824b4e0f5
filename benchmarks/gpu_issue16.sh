#!/usr/bin/env bash
# Issue 16 (the engine core in its own process) on the GPU in one device call: GPU tests of the engine
# process and the engine paths it drives, then `pellucid bench serve`: the offline engine, the server
# with its engine core in its own process, and the previous in-thread design, on the same requests.
# Usage (device tool): bash benchmarks/gpu_issue16.sh [SECTION ...]   sections: tests serve throughput
# FastAPI (with opentelemetry-api), uvicorn, pyzmq and msgspec are not installed there: carry their wheels (.whl, see the device
# tool's README). $OUT/summary.md gets every table; $OUT/all.log every command's full output.
set -u
OUT=${OUT:-/tmp/gpu_issue16}
TOTAL_S=${TOTAL_S:-570}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
sections=${*:-tests serve}
date -u +"date: %Y-%m-%dT%H:%MZ" | tee "$OUT/summary.md"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.md"
python3 -c "import torch, triton, transformers, zmq, msgspec, fastapi; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/summary.md"
nproc | sed 's/^/host cores: /' | tee -a "$OUT/summary.md"

run() {  # run NAME TIMEOUT CMD...: full output to all.log, tables and verdicts to summary.md
  local name=$1 limit=$2; shift 2
  local left=$((TOTAL_S - SECONDS))
  if [ "$left" -lt 20 ]; then echo "-- $name skipped: out of time" | tee -a "$OUT/summary.md"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name: $*" | tee -a "$OUT/summary.md"
  local t0=$SECONDS
  echo "==== $name" >> "$OUT/all.log"
  timeout "$limit" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?
  cat "/tmp/$name.log" >> "$OUT/all.log"
  grep -E '^\||passed|failed|Error|PASSED|FAILED|error' "/tmp/$name.log" | tail -40 >> "$OUT/summary.md"
  echo "-- $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.md"
}

for s in $sections; do
  case $s in
    tests)
      run gpu_tests 150 python3 -m pytest -q -x -rs -p no:cacheprovider tests/gpu/test_engine_process_gpu.py \
        tests/gpu/test_no_sync.py tests/gpu/test_async_scheduling.py tests/gpu/test_gpu_engine.py ;;
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
