"""Kernels for CPUs, in C++ through XLA's FFI: what XLA:CPU does slowly for serving-sized batches.

  ragged_paged_attention.py  the contract of kernels_pallas/ragged_paged_attention/reference.py
                             (the specification), reading KV rows straight from the pages
  build.py                   compiling csrc/ at first use (system C++ compiler, -march=native),
                             caching the library, registering the FFI targets
  csrc/                      the C++ sources (common.h: loads, AVX-512 helpers, the thread pool)

Every kernel is checked against its jnp specification on random ragged inputs
(tests/kernels/test_cpu_kernels.py). `available()` says whether they load here; without a C++
compiler the engine keeps its jnp paths.
"""

from kernels_cpu.build import KernelsUnavailable, available, load
from kernels_cpu.ragged_paged_attention import ragged_paged_attention

__all__ = ["KernelsUnavailable", "available", "load", "ragged_paged_attention"]
