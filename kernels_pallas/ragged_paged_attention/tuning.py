"""Block sizes of the ragged paged attention kernels, in one place (untuned on hardware yet: the
values are reasoned defaults; `scripts/bench_kernels.py` is how to tune them).

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
"""

TPU_QUERIES_PER_BLOCK = 16
TPU_KV_PAGES_PER_BLOCK = 8

GPU_ROWS_PER_BLOCK = 64
GPU_KEYS_PER_BLOCK = 64
GPU_TARGET_PROGRAMS = 256
GPU_MAX_KV_SPLITS = 16
GPU_MIN_KV_BLOCKS_PER_SPLIT = 4
