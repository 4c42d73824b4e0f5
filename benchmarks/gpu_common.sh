# Sourced by the benchmarks/gpu_issue*.sh scripts: one device call runs a script's sections in order.
# Set before sourcing: OUT (its summary.md gets every table and verdict as it is made, all.log every
# command's full output), TOTAL_S (run() starts no command once that many seconds are spent), and
# SUMMARY_PATTERN / SUMMARY_LINES (which lines of a command's output go to summary.md, and how many).
# The device lacks FastAPI (and opentelemetry-api), uvicorn (with uvloop, httptools), pyzmq, msgspec and aiohttp:
# carry their cp312 wheels in .whl (git-ignored; see the device tool's README) and they are installed here.
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SUMMARY_PATTERN=${SUMMARY_PATTERN:-'^\||passed|failed|Error|PASSED|FAILED'}
SUMMARY_LINES=${SUMMARY_LINES:-40}
date -u +"date: %Y-%m-%dT%H:%MZ" | tee -a "$OUT/summary.md"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.md"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/summary.md"

run() {  # run NAME TIMEOUT CMD...: full output to all.log, the summary lines to summary.md
  local name=$1 limit=$2; shift 2
  local left=$((TOTAL_S - SECONDS))
  if [ "$left" -lt 20 ]; then echo "-- $name skipped: out of time" | tee -a "$OUT/summary.md"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name: $(env | grep '^PELLUCID_' | sort | tr '\n' ' ')$*" | tee -a "$OUT/summary.md"
  local t0=$SECONDS
  echo "==== $name" >> "$OUT/all.log"
  timeout "$limit" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?
  cat "/tmp/$name.log" >> "$OUT/all.log"
  grep -E "$SUMMARY_PATTERN" "/tmp/$name.log" | tail -"$SUMMARY_LINES" >> "$OUT/summary.md"
  echo "-- $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.md"
}
