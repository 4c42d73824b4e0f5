#!/usr/bin/env bash
# Quality figures of the embedded default model on its held-out text (BENCHMARKS.md, docs/flashhead.md):
# FlashHead's greedy agreement and perplexity delta against the dense head at several probe counts (512 = every
# cluster = the dense head), then the perplexity through the engine; each in bfloat16 and float32.
# `python -m pellucid.eval.cli` is `pellucid eval` without the server's imports (FastAPI is not everywhere).
#   [DEVICE=cpu] bash benchmarks/eval_default_model.sh [OUT_DIR] [--max-tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out="${1:-${OUT:-/tmp/eval_default_model}}"; mkdir -p "$out"; shift || true
data=benchmarks/data/default_model_val.txt
device="${DEVICE:-auto}"
probes=4,8,16,32,64,128,256,512
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
engine="\"device\": \"$device\", \"gpu_memory_utilization\": 0.5"   # room for the heads beside the KV cache
for dtype in bfloat16 float32; do
    python3 -m pellucid.eval.cli agree --data "$data" --reference "{\"dtype\": \"$dtype\", $engine}" \
        --head flashhead --probes "$probes" --json "$out/agree_$dtype.json" "$@" 2>&1 | grep -v "^INFO "
done
for dtype in bfloat16 float32; do
    python3 -m pellucid.eval.cli ppl --data "$data" --dtype "$dtype" --device "$device" --json "$out/ppl_$dtype.json" "$@" \
        2>&1 | grep -v "^INFO "
done
