#!/usr/bin/env bash
# The device call that trained the committed default model (pellucid/data/default-model/README.md).
# Run from a checkout holding corpus/ (train.jsonl.xz, val.jsonl.xz, manifest.json) and tokenizer/.
#   1. a 40-step probe measures the step time; the step count is chosen once from it so that a run
#      trains for about TARGET_S seconds (rounded down to a multiple of 100 steps),
#   2. run 1 trains with that step count: the committed model,
#   3. run 2 repeats run 1's command (another --out) when the call has time left: the reproducibility check.
# Files under $OUT: run 1's weights in 15 MB pieces (the device returns files of at most 16 MB), its small
# files as a tar, both logs and run 2's training.json.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/device_out}"; mkdir -p "$OUT"
TARGET_S="${TARGET_S:-170}"
EXTRA=(${SMOKE_ARGS:-})  # CPU smoke tests only (with MIN_STEPS=10): "--max-docs 50 --batch-size 2 --seq-len 64 --val-windows 4"
begin=$(date +%s)
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'tokenizers', tokenizers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"

python3 -m pellucid.training.train --corpus corpus --tokenizer tokenizer --out /tmp/probe --steps 40 \
    --log-every 10 --eval-every 0 "${EXTRA[@]}" > "$OUT/probe.log" 2>&1
steps=$(python3 - "$TARGET_S" "${MIN_STEPS:-500}" <<'EOF'
import json, sys
history = json.load(open("/tmp/probe/training.json"))["history"]
first, last = history[1], history[-1]       # skip step 0 (CUDA start-up)
per_step = (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])
print(max(int(sys.argv[2]), min(4000, int(float(sys.argv[1]) / max(per_step, 1e-6) / 100) * 100)))
EOF
)
echo "probe: $(tail -3 "$OUT/probe.log" | head -1)"; echo "steps chosen: $steps"

command=(python3 -m pellucid.training.train --corpus corpus --tokenizer tokenizer --steps "$steps" "${EXTRA[@]}")
"${command[@]}" --out /tmp/run1 2>&1 | tee "$OUT/run1.log"
elapsed=$(( $(date +%s) - begin ))
echo "run 1 done after ${elapsed} s"
if [ "$elapsed" -lt "${RUN2_IF_UNDER_S:-300}" ]; then
    "${command[@]}" --out /tmp/run2 2>&1 | tee "$OUT/run2.log"
    cp /tmp/run2/training.json "$OUT/run2_training.json"
else
    echo "no time left for run 2 in this call"
fi

(cd /tmp/run1 && split -b 15000000 -d model.safetensors "$OUT/model.safetensors.part" && sha256sum model.safetensors > "$OUT/model.sha256" \
    && tar -cf "$OUT/run1_small.tar" config.json generation_config.json tokenizer.json tokenizer_config.json \
       special_tokens_map.json training.json)
python3 - <<'EOF'
import json, os
for run in ("run1", "run2"):
    path = f"/tmp/{run}/training.json"
    if os.path.exists(path):
        r = json.load(open(path))
        print(f"{run}: steps {r['args']['steps']}, {r['tokens_seen']:,} tokens, {r['train_seconds']} s, "
              f"val loss {r['val_loss']:.4f}, val perplexity {r['val_perplexity']:.4f}")
EOF
echo "total $(( $(date +%s) - begin )) s"
