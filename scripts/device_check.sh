#!/bin/bash
# One prepared run for a lent NVIDIA GPU machine (sessions get ~15 minutes of device time in all).
# It runs on that machine's own python3 (Python 3.12, jax 0.11.2 with CUDA, pytest, absl,
# tokenizers, jinja2, ... already installed; no network): only `gguf` and `ml_collections` are
# missing, carried as wheels in .whl/ (`make wheelhouse` here first). From this machine:
#
#   make wheelhouse
#   device run: command "bash scripts/device_check.sh", carry [".whl"], timeout_s 580
#   (or two shorter runs: STAGES=tests,bench, then STAGES=decode,prefill,serve; TESTS=files and
#   TESTS_K=expression narrow the tests)
#
# Stages, in order of importance, each under its own time limit (STAGES=tests,bench,... picks):
#   tests   the kernel tests compiled on the GPU (gpu-marked; the Mosaic GPU kernels' first, as
#           they have never run on hardware) + the engine with the Pallas backend
#   layers  scripts/bench_decode.py: SmolLM2 shapes (random weights, bf16) decoding at batch 1
#           and 32 with the layers scanned (the default since 2026-11-30) and unrolled: step time
#           (does XLA slice the stacked weights without copying them?) and compile seconds
#   graphs  bench_decode (host vs device ms a step) under XLA command-buffer settings and with the
#           reference attention: is the batch-1 step launch-bound? (not in the default STAGES)
#   async   scripts/bench_async.py: SmolLM2 shapes (random weights, bf16) at batch 1, 16 and 64,
#           synchronous steps against async scheduling (host, waited and device ms a step): is a
#           step's wall time within 10 % of its device time with async at batch 16? (sets
#           config.ASYNC_BY_DEFAULT for GPUs; not in the default STAGES until it has run once)
#   moe     scripts/bench_moe.py: a mixture-of-experts MLP (Mixtral- and Qwen3-MoE-like, bf16) at
#           1/16/256 tokens against the dense MLP of its active parameters, and one grouped
#           projection by ragged_dot (the GPU default) against one dot of its FLOPs: is XLA:GPU's
#           ragged_dot a grouped GEMM (issue 39)? (not in the default STAGES: STAGES=moe)
#   kvquant scripts/bench_kv_cache.py: SmolLM2 shapes (random weights, bf16) decoding 64
#           sequences of 4k and 8k tokens over a bf16, int8 and fp8 KV cache (the Triton kernel):
#           does reading half the bytes make the step faster on a GPU? (issue 41; not in the
#           default STAGES: STAGES=kvquant)
#   bench   scripts/bench_kernels.py: decode-heavy, prefill-heavy and mixed batches (llama3-8b-like
#           heads, bf16), our kernels (Mosaic GPU, Triton) against the reference, JAX's Pallas ops
#           and cuDNN, with Mosaic GPU block-size, stage and warp-specialized variants, and the
#           measured copy/matmul ceilings (the Triton sweeps of 2026-11-29 are in tuning.py)
#   prefill one 2048- and one 8192-token prompt: flash (Mosaic GPU, with and without ping-pong;
#           Triton) vs ragged vs cuDNN vs JAX's mha and FA3 (two block configs)
#   decode  decode batches of several shapes (long contexts with few sequences: split-KV), ours
#           (mgpu, gpu) against JAX's paged_attention, with variants
#   serve   scripts/benchmark.py on SmolLM2 shapes (random weights): gpu and mgpu kernels vs
#           reference attention (SERVE_KERNELS="... mgpu_ws" adds the warp-specialized mgpu)
# The limits add up to ~930 s; 2026-12-04's run: tests, layers, bench and prefill took 435 s
# (timeout_s 560, the machine's start not counted), decode 110 s; serve needs its own run.
# Results land in $WORK (default /tmp/device_check) and, after every stage, in
# $OUT/results.tgz (the tool brings back at most 8 files) beside $OUT/summary.txt.
set -u
OUT=${OUT:-out/device}
WORK=${WORK:-/tmp/device_check}
STAGES=${STAGES:-tests,layers,bench,prefill,decode,serve}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
PLATFORM=${PLATFORM:-cuda}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
save() { tar czf "$OUT/results.tgz" -C "$WORK" . 2>/dev/null; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }

log "devices"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 \
  | tee -a "$OUT/summary.txt"
$PY -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/summary.txt"
# JAX's FA3 refuses causal masking on CUDA 12.8.0-12.9.0 (a ptxas miscompilation): record it.
$PY -c "from jax._src.lib import cuda_versions as c; print('cuda runtime', c and \
c.cuda_runtime_get_version(), 'cudnn', c and c.cudnn_get_version())" 2>&1 | tee -a "$OUT/summary.txt"
if ! $PY -c "import gguf, ml_collections" 2>/dev/null; then
  log "installing carried wheels from .whl/ into /tmp/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

if want tests; then
  log "tests: kernels compiled on the GPU + the engine on the Pallas backend, 150 s at most"
  # Full float32 in XLA's matmuls too (the GPU default is TF32), so float32 references are exact.
  # SIGINT at the limit: pytest stops and still prints the failures so far (2026-12-04 a plain
  # kill left only "..F.F....": two failures, no names). -v names each test as it ends.
  # cpu beside the GPU: tests count kernel runs with jax.debug.callback, which needs a CPU device
  # (2026-12-04's two flash prefill "failures" were only that).
  JAX_PLATFORMS=$PLATFORM,cpu JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT -k 15 150 \
    $PY -m pytest -v -rfE --tb=short -p no:cacheprovider --timeout 90 -m "gpu or not slow" ${TESTS:-tests/kernels/test_rpa_mgpu.py \
    tests/kernels/test_flash_prefill_mgpu.py tests/kernels/test_rpa_gpu.py tests/kernels/test_flash_prefill_gpu.py \
    tests/kernels/test_rpa_engine.py tests/kernels/test_rpa_quantized.py::test_compiled_gpu_kernel_equals_the_reference} \
    -k "not Interpret${TESTS_K:+ and $TESTS_K}" --durations=8 > "$WORK/kernel_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR" "$WORK/kernel_tests.log" | grep -v "^=" | sed 's/ *\[ *[0-9]*%\]//' \
    | tail -60 | tee -a "$OUT/summary.txt"
  tail -25 "$WORK/kernel_tests.log" | tee -a "$OUT/summary.txt"
  save
fi

if want layers; then
  log "layers: decode step and compile time, layers scanned vs unrolled, 90 s at most"
  JAX_PLATFORMS=$PLATFORM timeout 90 $PY scripts/bench_decode.py --load_format dummy \
    --dtypes bfloat16 --batch_sizes 1,32 --layer_loops scan,unroll --decode_steps 32 \
    --json_out "$WORK/layer_loop.json" 2>"$WORK/layer_loop.log" | tee "$WORK/layer_loop.txt" \
    | tail -6 | tee -a "$OUT/summary.txt"
  save
fi

if want graphs; then
  log "graphs: decode step, host vs device, by XLA command-buffer (CUDA graph) setting; 260 s at most"
  # 2026-12-04: a batch-1 step of SmolLM2 took 2.4-5 ms on the device (the weights take 0.12 ms to
  # read): launch-bound. Which XLA setting (CUDA graphs of the whole step, while loops inside
  # them) or attention backend removes the launches?
  G="$PY scripts/bench_decode.py --load_format dummy --dtypes bfloat16 --batch_sizes 1,32"
  G="$G --decode_steps 16 --warmup_steps 3"
  CB=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
  for v in "default||unroll,scan" "reference||unroll|--attention_backends reference" \
      "no_graphs|--xla_gpu_enable_command_buffer=|unroll" \
      "while_in_graphs|--xla_gpu_enable_command_buffer=$CB,WHILE,CONDITIONAL|scan,unroll"; do
    IFS='|' read -r name flags loops extra <<< "$v"
    echo "-- $name XLA_FLAGS=$flags loops=$loops $extra" | tee -a "$OUT/summary.txt"
    XLA_FLAGS=$flags JAX_PLATFORMS=$PLATFORM timeout 65 $G --layer_loops $loops $extra \
      --json_out "$WORK/graphs_$name.json" 2>"$WORK/graphs_$name.log" | grep -v "^wrote" \
      | tail -5 | tee -a "$OUT/summary.txt"
  done
  save
fi

if want async; then
  log "async: synchronous vs async scheduling, SmolLM2 shapes, batch 1/16/64; 120 s at most"
  JAX_PLATFORMS=$PLATFORM timeout 120 $PY scripts/bench_async.py --load_format dummy \
    --dtype bfloat16 --batch_sizes 1,16,64 --max_tokens 48 --rounds 2 \
    --json_out "$WORK/async.json" 2>"$WORK/async.log" | grep -v "^wrote" | tail -8 \
    | tee -a "$OUT/summary.txt"
  save
fi

if want moe; then
  log "moe: MoE MLP vs dense, grouped matmul (ragged_dot) vs dot, bf16; 120 s at most"
  JAX_PLATFORMS=$PLATFORM timeout 120 $PY scripts/bench_moe.py --dtype bfloat16 --repeats 10 \
    --json_out "$WORK/moe.json" 2>"$WORK/moe.log" | grep -v "^wrote" | tail -9 \
    | tee -a "$OUT/summary.txt"
  save
fi

if want kvquant; then
  log "kvquant: decode over a bf16 / int8 / fp8 KV cache, batch 64, 4k and 8k; 150 s at most"
  JAX_PLATFORMS=$PLATFORM timeout 150 $PY scripts/bench_kv_cache.py --load_format dummy \
    --dtype bfloat16 --batch 64 --contexts 4096,8192 --kv_cache_dtypes auto,int8,fp8_e4m3 \
    --json_out "$WORK/kv_cache.json" 2>"$WORK/kv_cache.log" | tail -12 | tee -a "$OUT/summary.txt"
  save
fi

B="$PY scripts/bench_kernels.py --rounds 5 --iters 20"
if want bench; then
  log "bench: decode 64 x 4096, prefill 2048, mixed; variants; 170 s at most"
  JAX_PLATFORMS=$PLATFORM timeout 170 $B --measure_roofline \
    --num_decodes 64 --decode_kv_len 4096 --prefill_len 2048 \
    --variant mgpu:num_stages=2 --variant mgpu:num_stages=3 --variant mgpu:num_stages=6 \
    --variant mgpu:pages_per_block=8 --variant mgpu:pages_per_block=8,num_stages=2 \
    --variant mgpu:num_kv_splits=2 --variant gpu:block_q=32,pages_per_block=8,num_warps=8 \
    --variant mgpu:warp_specialized=1 --variant mgpu:warp_specialized=1,num_consumers=1 \
    --variant mgpu:warp_specialized=1,num_consumers=2 \
    --json_out "$WORK/bench_kernels.json" 2>"$WORK/bench_kernels.log" | tee "$WORK/bench_kernels.txt"
  tail -3 "$WORK/bench_kernels.log" >> "$OUT/summary.txt"
  save
fi

if want prefill; then
  log "prefill: one 2048- and one 8192-token prompt, flash vs ragged vs cuDNN; 100 s at most"
  P="$B --batches prefill --implementations reference,mgpu,gpu,flash_mgpu,flash_gpu,jax_gpu_mha"
  P="$P,jax_gpu_fa3,cudnn"
  for n in 2048 8192; do
    JAX_PLATFORMS=$PLATFORM timeout 50 $P --prefill_len $n \
      --variant flash_mgpu:pingpong=0 --variant flash_mgpu:num_stages=2 \
      --variant flash_mgpu:block_kv=64 --variant flash_mgpu:p_in_smem=1 \
      --variant jax_gpu_fa3:block_kv=128 \
      --variant mgpu:num_stages=2 --variant mgpu:pages_per_block=8,num_stages=2 \
      --variant mgpu:warp_specialized=1 --variant mgpu:warp_specialized=1,pages_per_block=8 \
      --json_out "$WORK/prefill_$n.json" 2>"$WORK/prefill_$n.log" | tee "$WORK/prefill_$n.txt"
  done
  save
fi

if want decode; then
  log "decode: 64 x 4096, 256 x 2048, 8 x 32768 (split-KV), ours vs JAX's paged_attention; 120 s"
  D="$B --batches decode --implementations reference,mgpu,gpu,jax_gpu"
  JAX_PLATFORMS=$PLATFORM timeout 45 $D --num_decodes 64 --decode_kv_len 4096 \
    --variant mgpu:num_stages=2 --variant mgpu:num_stages=8 --variant mgpu:pages_per_block=8 \
    --variant mgpu:pages_per_block=8,num_stages=4 --variant mgpu:num_kv_splits=2 \
    --variant mgpu:warp_specialized=1 --variant mgpu:warp_specialized=1,pages_per_block=8 \
    --variant jax_gpu:num_warps=4 \
    --json_out "$WORK/decode_64x4096.json" 2>"$WORK/decode_64x4096.log" | tee "$WORK/decode_64x4096.txt"
  JAX_PLATFORMS=$PLATFORM timeout 35 $D --num_decodes 256 --decode_kv_len 2048 \
    --variant mgpu:num_stages=2 \
    --json_out "$WORK/decode_256x2048.json" 2>"$WORK/decode_256x2048.log" | tee "$WORK/decode_256x2048.txt"
  JAX_PLATFORMS=$PLATFORM timeout 40 $D --num_decodes 8 --decode_kv_len 32768 \
    --variant mgpu:num_kv_splits=4 --variant mgpu:num_kv_splits=16 \
    --variant mgpu:num_kv_splits=16,num_stages=2 \
    --variant mgpu:warp_specialized=1,num_kv_splits=16 \
    --json_out "$WORK/decode_8x32768.json" 2>"$WORK/decode_8x32768.log" | tee "$WORK/decode_8x32768.txt"
  save
fi

if want serve; then
  log "serve: SmolLM2 shapes (random weights), ${SERVE_KERNELS:-gpu mgpu reference} kernels,"
  log "  the workload rehearsed once, so compiles are not timed; 300 s"
  for name in ${SERVE_KERNELS:-gpu mgpu reference}; do  # mgpu_ws: the warp-specialized form
    backend=pallas kernel=${name%_ws} options=""
    [[ $name == reference ]] && backend=reference kernel=auto
    [[ $name == mgpu_ws ]] && options="warp_specialized=true"
    # (layers unrolled on GPUs by default since 2026-12-04: ~7 s a step shape to compile)
    JAX_PLATFORMS=$PLATFORM timeout 100 $PY scripts/benchmark.py --model smollm2-135m-instruct \
      --load_format dummy --dtype bfloat16 --workload fixed --num_requests 16 --qps inf \
      --prompt_len 256 --output_len 32 --policies sarathi --tbt_slo 0.1 --warmup 4 --rehearse \
      --attention_backend $backend --pallas_kernel $kernel --kernel_options "$options" \
      --json_out "$WORK/serve_$name.json" \
      2>"$WORK/serve_$name.log" | tee "$WORK/serve_$name.txt" \
      | grep -E "throughput|TPOT P50|TTFT P50" | tee -a "$OUT/summary.txt"
  done
  save
fi
log "done"
