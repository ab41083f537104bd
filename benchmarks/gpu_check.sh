#!/usr/bin/env bash
# The checks that need a CUDA machine, as one script (a lent GPU machine runs it from the repository root; nothing is
# installed there but torch and transformers, so waferline runs from src/ and the server's packages come as wheels in
# .whl/ when present). Each part has its own time limit, so a slow one cannot starve the others; outputs go to
# $OUT (default: gpu_check_out/); the limits sum to 540 s (tests 120, serve 150, decode 120, step
# launches 50 for each of its three runs; the 2026-12-05 H100 run took 19 / 142 / 45 / 21 s), under a lent
# machine's 600 s per command.
#
#   1. tests/test_cuda.py: graph decode = eager decode, GPU log-probs = the CPU engine's, int4 through tinygemm,
#      speculative decoding (n-gram, MTP, a draft model) = plain decoding on the GPU, `serve --device cuda` through
#      the openai client = `LLM.generate` on the GPU;
#   2. the serve load on the machine's CPU cores: one process against 2 stage processes x 2 micro-batches (1 thread
#      each) and one process with 2 threads, int4 weights (SERVE_WEIGHTS=fp32: 32-bit) (benchmarks/
#      serve_load_llamacpp.py --pipelines 2x2 --pipeline-weights int4);
#   3. decode speed on the GPU against its HBM roofline (benchmarks/decode_speed.py --device cuda, llama-gpu);
#   4. operations and eager time per decode step on the GPU (benchmarks/step_launches.py --device cuda): narrowed to
#      hidden 256, then llama-gpu at its own width with one torch thread and with one per core (an eager step of
#      the full-width model took 32 ms in decode_speed.py, 16 threads, against 5.4 ms narrowed, one thread).
# Everything printed goes to $OUT/gpu_check.log; each part's result is one JSON file beside it (six files in all).
set -u
OUT=${OUT:-gpu_check_out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WAFERLINE_KERNELS=0 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L 2>&1 | tee "$OUT/gpu_check.log"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
"transformers", transformers.__version__)' 2>&1 | tee -a "$OUT/gpu_check.log"
nproc | tee -a "$OUT/gpu_check.log"
# the result files are named after the card (h100, h200, ...): timings compare only within one kind of card
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[a-z][0-9]{2,4}' | head -1 \
    | tr 'A-Z' 'a-z')
GPU=${GPU:-gpu}

t0=$(date +%s)
timeout "${TESTS_S:-120}" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee -a "$OUT/gpu_check.log"
echo "== tests: $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
# SERVE_WEIGHTS=int4 (default: the stages quantized on load) or fp32
if [ "${SERVE_WEIGHTS:-int4}" = int4 ]; then SERVE_ROWS="waferline:int4 --pipeline-weights int4"; else SERVE_ROWS="waferline:fp32"; fi
# shellcheck disable=SC2086
timeout "${SERVE_S:-150}" "$PY" benchmarks/serve_load_llamacpp.py --engines $SERVE_ROWS --pipelines 2x2 \
    --threads 1 --clients "${SERVE_CLIENTS:-16}" --duration 15 --max-tokens 32 --out "$OUT/serve_pipeline_$GPU.json" 2>&1 \
    | grep -v "Writing model shards" | tee -a "$OUT/gpu_check.log"
echo "== serve load: $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
timeout "${DECODE_S:-120}" "$PY" benchmarks/decode_speed.py --device cuda --models llama-gpu --repeats 1 \
    --threads "$(nproc)" --json "$OUT/decode_speed_$GPU.json" 2>&1 | tee -a "$OUT/gpu_check.log"
echo "== decode speed: $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
timeout "${LAUNCH_S:-50}" "$PY" benchmarks/step_launches.py --device cuda --models llama-gpu dsv3-gpu \
    --out "$OUT/step_launches_$GPU.json" 2>&1 | tee -a "$OUT/gpu_check.log"
for th in 1 "$(nproc)"; do
    timeout "${LAUNCH_S:-50}" "$PY" benchmarks/step_launches.py --device cuda --models llama-gpu --full-width \
        --threads "$th" --out "$OUT/step_launches_full_${th}t_$GPU.json" 2>&1 | tee -a "$OUT/gpu_check.log"
done
echo "== step launches: $(( $(date +%s) - t0 )) s"
