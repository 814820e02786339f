"""Block sizes of the ragged paged attention kernels, in one place. The GPU values were checked on
one H200 (2026-11-29, bf16, K=8 Q=4 H=128, page 16; `scripts/bench_kernels.py --variant ...`, the
sweep in scripts/device_check.sh; README "Kernels"); the TPU values are reasoned, not measured.

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
Mosaic GPU (kernel_mgpu.py), reasoned, not yet measured:
  MGPU_KEYS_PER_BLOCK     keys per pipeline step (pages_per_block = this // page_size): the
                          [64, keys] score tile and wgmma's N dimension.
  MGPU_NUM_STAGES         KV steps in flight (SMEM slots): 4 x 2 x 64 keys x 128 x 2 bytes =
                          128 KiB of K and V per program, ~4x what one SM needs in flight to
                          cover HBM latency at full bandwidth.
  MGPU_WARP_SPECIALIZED   False: one warpgroup per program issues its own page copies between
                          its matmuls; True: a producer warpgroup copies pages while one or two
                          consumer warpgroups (two q tiles sharing each KV step, taking turns on
                          the tensor cores) attend. Off until device_check.sh times the two.
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
MGPU_NUM_STAGES = 4
MGPU_WARP_SPECIALIZED = False
