"""Pallas attention kernels (GPU, TPU, CPU interpret mode); see DESIGN.md principle 8.

Empty until the kernel issue lands: the engine attends with `llmjax.model.attention`'s reference.
"""
