"""Block sizes of the flash prefill kernels, and where the engine uses them. GPU values measured on
one H200 (2026-11-29, bf16, K=8 Q=4 H=128; scripts/device_check.sh's prefill sweep;
docs/kernels.md); TPU values reasoned, not measured. Arguments override them.

TPU (kernel_tpu.py): TPU_BLOCK_Q tokens per q block (x Q query heads = matmul rows) and
TPU_BLOCK_KV keys per kv block (one lane-width score tile).
GPU (kernel_gpu.py): GPU_ROWS_PER_BLOCK query rows (tokens x padded query heads) per program,
GPU_KEYS_PER_BLOCK keys per inner KV step, GPU_NUM_STAGES Triton pipelining stages (num_warps: 8
for head_dim > 64, else 4).
  Measured (ms; a 2048-token / an 8192-token prompt): 128 rows, 64 keys, 8 warps, 3 stages
  0.156 / 1.656 (the defaults: 220 / 332 TFLOP/s, 22 / 34 % of the 989 TFLOP/s data sheet); the
  same with 2 stages 0.175 / 1.823; 64 rows, 4 warps, 3 stages 0.152 / 1.756; 64 rows, 128 keys,
  4 warps, 2 stages 0.186 / 1.980. Beside them on the same prompts: cuDNN 0.103 / 1.044, JAX's
  Triton mha 0.141 / 1.395, our ragged paged attention kernel 0.241 / 2.528.

ENGINE_MIN_TOKENS: per platform, the smallest token bucket in which the engine attends a lone
fresh prompt (one sequence, nothing cached) with flash prefill instead of the ragged kernel when
`EngineConfig.flash_prefill` is 'auto'. GPU: flash was 1.55x the ragged kernel at 2048 tokens and
1.53x at 8192; shorter prompts were not measured, so the threshold is the smallest measured size.
TPU: not measured, so off (None). mgpu (the Mosaic GPU flash kernel beside the Mosaic GPU ragged
kernel, H200, 2026-12-04): flash 0.107 vs ragged 0.309 ms at 2048 tokens (2.9x), 1.057 vs 2.944
at 8192 (2.8x), so the same 2048-token threshold.

Mosaic GPU (kernel_mgpu.py), measured on the H200 on 2026-12-04 (ms; 2048 / 8192 tokens, bf16,
K=8 Q=4 H=128): the defaults below (128 keys, 2 stages, ping-pong consumers) 0.099 / 0.971
(346 / 566 TFLOP/s, 35 / 57 % of the data sheet); 4 stages 0.107 / 1.057; without the ping-pong
0.107 / 1.092; 64 keys 0.118 / 1.251; P staged in SMEM 0.108 / 1.136. Beside it: cuDNN 0.101 /
0.998, JAX's Triton mha 0.141 / 1.386, our Triton flash kernel 0.162 / 1.668.
"""

TPU_BLOCK_Q = 128
TPU_BLOCK_KV = 128

GPU_ROWS_PER_BLOCK = 128
GPU_KEYS_PER_BLOCK = 64
GPU_NUM_STAGES = 3

ENGINE_MIN_TOKENS = {"gpu": 2048, "tpu": None, "mgpu": 2048}

# Mosaic GPU (kernel_mgpu.py): 128 keys per KV block (as FlashAttention-3) and 2 blocks in flight
# (measured above); kernel_mgpu.fit_num_stages keeps as many as fit 227 KiB of SMEM beside the two
# q tiles (bf16 at head_dim 256: 1; there block_kv=64 fits 2).
MGPU_KEYS_PER_BLOCK = 128
MGPU_NUM_STAGES = 2
