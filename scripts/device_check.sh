#!/bin/bash
# One prepared run for a lent NVIDIA GPU machine (sessions get ~15 minutes of device time in all).
# It runs on that machine's own python3 (Python 3.12, jax 0.11.2 with CUDA, pytest, tokenizers,
# jinja2, ... already installed; no network): only `gguf` is missing, carried as a wheel in .whl/
# (`make wheelhouse` here first). From this machine:
#
#   make wheelhouse
#   device run: command "bash scripts/device_check.sh", carry [".whl"], timeout_s 540
#
# Writes under $OUT (default out/device): the compiled-kernel tests' log, the kernel benchmark
# (JSON + table) and a short serving benchmark with the Pallas backend vs the reference.
set -u
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
PLATFORM=${PLATFORM:-cuda}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

log "devices"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/summary.txt"
$PY -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/summary.txt"
if ! $PY -c "import gguf" 2>/dev/null; then
  log "installing carried wheels from .whl/"
  $PY -m pip install --quiet --no-index --no-deps --target "$OUT/.site" .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:$OUT/.site
fi

log "kernel tests compiled on the device (gpu-marked), 240 s at most"
JAX_PLATFORMS=$PLATFORM timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/kernels \
  -x --durations=10 2>&1 | tee "$OUT/kernel_tests.log" | tail -15

log "kernel benchmark (bf16, llama3-8b-like heads), 150 s at most"
JAX_PLATFORMS=$PLATFORM timeout 150 $PY scripts/bench_kernels.py --iters 20 \
  --json_out "$OUT/bench_kernels.json" 2>"$OUT/bench_kernels.log" | tee "$OUT/bench_kernels.txt"

log "serving: SmolLM2 shapes (random weights), pallas vs reference attention, 120 s at most"
for backend in pallas reference; do
  JAX_PLATFORMS=$PLATFORM timeout 60 $PY scripts/benchmark.py --model smollm2-135m-instruct \
    --load_format dummy --dtype bfloat16 --workload fixed --num_requests 32 --qps inf \
    --prompt_len 512 --output_len 64 --policies sarathi --tbt_slo 0.1 --warmup 8 --norehearse \
    --attention_backend $backend --json_out "$OUT/serve_$backend.json" \
    2>"$OUT/serve_$backend.log" | tee "$OUT/serve_$backend.txt" | grep -E "throughput|TPOT P50|TTFT P50"
done
log "done"
