"""Block sizes of the ragged paged attention kernels, in one place. The GPU values were checked on
one H200 (2026-11-29, bf16, K=8 Q=4 H=128, page 16; `scripts/bench_kernels.py --variant ...`, the
sweep in scripts/device_check.sh; docs/kernels.md); the TPU values are reasoned, not measured.

TPU (kernel_tpu.py)
  TPU_QUERIES_PER_BLOCK   q tokens per grid step (bq); rows per step = bq * Q query heads per kv
                          head. Smaller wastes less matmul work on decode-heavy blocks.
  TPU_KV_PAGES_PER_BLOCK  KV pages per DMA step (ppb): bigger copies, more VMEM (2 slots x K and V).
GPU (kernel_gpu.py)
  GPU_ROWS_PER_BLOCK      ~query rows (tokens x padded query heads) per program: the [rows, H]
                          float32 accumulator stays in registers with 4 warps.
  GPU_KEYS_PER_BLOCK      ~keys per KV step (pages_per_block = this // page_size).
  GPU_TARGET_PROGRAMS     below this many (q block, kv head) programs the KV range is split
                          (flash decoding): about two per SM on an H200's 132 SMs.
  GPU_MAX_KV_SPLITS, GPU_MIN_KV_BLOCKS_PER_SPLIT  bounds on the split count.
  GPU_NUM_WARPS           warps per program.
  GPU_DECODE_NUM_STAGES   Triton software-pipelining stages for decode buckets (block_q = 1) and
  GPU_NUM_STAGES          for the others. Measured on the H200, 64 decodes x 4096 keys: 1 stage
                          0.354 ms (3.03 TB/s, 63% of the 4.8 TB/s data sheet), 2 stages 0.488 ms,
                          3 stages 0.752 ms: pipelining the page-table-indirect loads costs more
                          than it hides. Prefill chunks: 2 and 3 stages within 1%.
  Also measured there (64 x 4096 decode): 2 warps 0.479 ms, 1 warp 0.540, 8 warps 0.828; 128 keys
  per step 0.547, 32 keys 0.569; on 2048-token prefill chunks 64-row q blocks beat 128-row ones
  (0.241 vs 0.318 ms). 8 decodes x 32768 keys: 16 KV splits 0.478 ms, 4 splits 0.555, 1 split
  1.288 (the split rule picks 8 there: 0.568).
Mosaic GPU (kernel_mgpu.py), measured on the H200 on 2026-12-04 (scripts/device_check.sh; ms):
  MGPU_KEYS_PER_BLOCK     keys per pipeline step (pages_per_block = this // page_size): the
                          [64, keys] score tile and wgmma's N dimension. 128 keys (8 pages) was
                          within 4 % either way (64 x 4096 decode 0.431 vs 0.438 with 4 stages).
  MGPU_NUM_STAGES         KV steps in flight (SMEM slots). 2 beat 4 on every batch measured:
                          64 decodes x 4096 keys 0.359 vs 0.438 (3.0 TB/s, 62 % of the 4.8 TB/s
                          data sheet; 8 stages 0.447), 256 x 2048 0.664 vs 0.831, a mixed batch
                          0.372 vs 0.455, a 2048-token prefill chunk 0.251 vs 0.309, 8192 tokens
                          2.105 vs 2.944. As with Triton's stages, deeper pipelines of
                          page-table-indirect copies cost more than they hide.
  MGPU_WARP_SPECIALIZED   False: one warpgroup per program issues its own page copies between
                          its matmuls; True: a producer warpgroup copies pages while one or two
                          consumer warpgroups attend. With 4 stages it was 0.367 (64 x 4096),
                          0.386 (mixed), 1.908 (8192-token chunk; 2.105 unspecialized with 2
                          stages), 0.372 (8 x 32768 with 16 KV splits; 0.403 unspecialized):
                          better for long prefill chunks and long contexts, level or behind the
                          2-stage form on decodes and mixed batches; warp-specialized with 2
                          stages was not measured, so it stays off.
  Beside the Triton kernel (same run): 64 x 4096 0.366, 256 x 2048 0.655, 8 x 32768 0.401, mixed
  0.464, 2048-token chunk 0.242, 8192 2.554. The platform default stays Triton ('gpu'): level on
  decodes, and the Mosaic GPU kernel's engine path has open questions (device_check.sh's serve
  stage: 16 requests took 18.6 s with it vs 4.0 s with Triton, compiles not separated from
  steps; two flash-prefill engine tests failed on the hardware, tracebacks not captured).
"""

TPU_QUERIES_PER_BLOCK = 16
TPU_KV_PAGES_PER_BLOCK = 8

GPU_ROWS_PER_BLOCK = 64
GPU_KEYS_PER_BLOCK = 64
GPU_TARGET_PROGRAMS = 256
GPU_MAX_KV_SPLITS = 16
GPU_MIN_KV_BLOCKS_PER_SPLIT = 4
GPU_NUM_WARPS = 4
GPU_DECODE_NUM_STAGES = 1
GPU_NUM_STAGES = 2

MGPU_KEYS_PER_BLOCK = 64
MGPU_NUM_STAGES = 2
MGPU_WARP_SPECIALIZED = False
