#!/usr/bin/env bash
# Everything GPU-side of issue 4's runner path in one device call: GPU tests, then benchmarks.
# Usage (device tool): bash benchmarks/gpu_issue4.sh [SECTION ...]
#   sections: tests alltests profile profile8b qwen merged big throughput fused serial step tracing extraction
#             flashhead serve pdl kerneltests
# $OUT/summary.md gets every table as it is made; $OUT/all.log every command's full output. The whole
# script stops starting sections after TOTAL_S seconds (default 560) so one device call holds it.
set -u
OUT=${OUT:-/tmp/gpu_issue4}
TOTAL_S=${TOTAL_S:-560}
SUMMARY_PATTERN='^\||passed|failed|Error|PASSED|FAILED|agree'
SUMMARY_LINES=40
sections=${*:-tests qwen merged big throughput fused step}
. "$(dirname "$0")/gpu_common.sh"

for s in $sections; do
  case $s in
    tests) run gpu_tests 200 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu ;;
    kerneltests)   # the GPU cases outside tests/gpu, one file per run so a slow compile shows where
      for f in tests/attention/test_triton_backend.py tests/heads/test_flashhead_kernels.py tests/heads/test_flashhead.py \
          tests/tracing/test_taps.py tests/tracing/test_save_log.py tests/models/test_models_vs_hf.py; do
        run "gpu_$(basename "$f" .py)" 240 python3 -m pytest -q -rs -p no:cacheprovider "$f"
      done ;;
    alltests)   # every test file with CUDA-only cases
      run gpu_tests_all 300 python3 -m pytest -q -p no:cacheprovider -x tests/gpu tests/attention/test_triton_backend.py \
        tests/heads/test_flashhead_kernels.py tests/tracing/test_taps.py tests/runner/test_sampler.py \
        tests/attention/test_torch_ref.py tests/models/test_models_vs_hf.py ;;
    profile)
      run profile_qwen_b1 60 python3 benchmarks/decode_profile.py --model Qwen3-0.6B --batch 1
      run profile_qwen_b256 60 python3 benchmarks/decode_profile.py --model Qwen3-0.6B --batch 256 --top 12 ;;
    profile8b) run profile_llama8b_b1 90 python3 benchmarks/decode_profile.py --model Llama-3.1-8B --batch 1 --top 15 ;;
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
    serial)   # async scheduling is the CUDA default: the same runs stepping serially, for comparison
      run lat_qwen_serial 70 python3 -m pellucid.bench latency --model Qwen3-0.6B --batch-sizes 1,64,256 --output-len 64 --no-async-scheduling
      run throughput_qwen_serial 150 python3 -m pellucid.bench throughput --model Qwen3-0.6B --no-async-scheduling ;;
    step) OMP_NUM_THREADS=1 run step_overhead 60 python3 benchmarks/step_overhead.py --batch 256 --steps 300 ;;
    tracing)
      python3 -c "from pellucid.tiny_models import build_tiny_model as b; b('llama', '/tmp/m', hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048)" >/dev/null 2>&1
      run tracing_graphs 150 python3 benchmarks/tracing_bench.py --model /tmp/m --dtype bfloat16 --num-prompts 64 --output-len 64 --repeats 3 ;;
    extraction) run extraction_8b 240 python3 benchmarks/extraction_bench.py --model Llama-3.1-8B --min-len 1024 --max-len 2048 \
      --num-prompts 48 --max-num-batched-tokens 8192 --repeats 3 --out-root /tmp,/dev/shm ;;
    flashhead)
      run flashhead_head 120 python3 benchmarks/flashhead_bench.py --no-sweep
      run flashhead_e2e 120 python3 benchmarks/flashhead_bench.py --e2e --output-len 128 ;;
    pdl)   # programmatic dependent launch (pellucid.kernels.pdl) off vs on, batch-1 and batch-8 decode
      for m in ${PDL_MODELS:-Qwen3-0.6B Llama-3.1-8B}; do
        limit=45; [ "$m" = Llama-3.1-8B ] && limit=100
        lat="python3 -m pellucid.bench latency --model $m --batch-sizes 1,8 --output-len 64"
        PELLUCID_PDL=0 run lat_${m}_no_pdl $limit $lat
        run lat_${m}_pdl $limit $lat
      done ;;
    serve) run serve_qwen 150 python3 -m pellucid.bench serve --model Qwen3-0.6B ;;
  esac
done
echo "== summary"; cat "$OUT/summary.md"
