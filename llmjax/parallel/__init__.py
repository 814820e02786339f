"""Tensor and pipeline parallelism over `jax.sharding` meshes (ParallelConfig in
llmjax/config/parallel.py).

heads.py        how tp splits the attention heads (as they are, kv heads repeated, or padded)
mesh.py         the mesh, the one logical-axis -> mesh-axis rules table, weight placement
distributed.py  multi-host: jax.distributed start-up, host <-> global arrays, lockstep checks
"""
