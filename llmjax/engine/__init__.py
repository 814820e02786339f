"""Host side: scheduler, block manager, batch packing; only runner/ imports jax."""
