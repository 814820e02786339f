"""Block sizes of the flash prefill kernels (untuned on hardware: reasoned defaults, explained in
each kernel's header; arguments override them).

TPU (kernel_tpu.py): TPU_BLOCK_Q tokens per q block (x Q query heads = matmul rows) and
TPU_BLOCK_KV keys per kv block (one lane-width score tile).
GPU (kernel_gpu.py): GPU_ROWS_PER_BLOCK query rows (tokens x padded query heads) per program and
GPU_KEYS_PER_BLOCK keys per inner KV step.
"""

TPU_BLOCK_Q = 128
TPU_BLOCK_KV = 128

GPU_ROWS_PER_BLOCK = 128
GPU_KEYS_PER_BLOCK = 64
