"""Host side: scheduler, block manager, batch packing; only runner.py imports jax."""
