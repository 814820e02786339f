"""Which implementation of a kernel runs where, shared by every kernel folder's wrapper.

Implementations: 'tpu' (Pallas Mosaic TPU), 'gpu' (Pallas on the Triton lowering), 'mgpu' (Pallas
Mosaic GPU, Hopper), 'reference' (plain jnp). With no name, the
platform's kernel: gpu on CUDA/ROCm, tpu on TPU and on the CPU (in interpret mode, for checking). A
kernel named on a platform where it cannot compile raises unless interpret=True: nothing silently
falls back.
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("tpu", "gpu", "mgpu", "reference")
COMPILES_ON = {"tpu": ("tpu",), "gpu": ("gpu", "cuda"), "mgpu": ("gpu", "cuda")}


def default_implementation(platform: str | None = None) -> str:
    """The kernel for `platform` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"


def choose_implementation(
    kernel: str, implementation: str | None, interpret: bool | None
) -> tuple[str, bool]:
    """-> (implementation, interpret) for one call of `kernel` (its name, for errors).
    `interpret` defaults to True on the CPU (where no kernel compiles) and False elsewhere."""
    platform = jax.default_backend()
    impl = implementation or default_implementation(platform)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown {implementation=}; choose one of {IMPLEMENTATIONS}")
    if impl == "reference":
        return impl, False
    if interpret is None:
        interpret = platform == "cpu"
    if not interpret and platform not in COMPILES_ON[impl]:
        raise RuntimeError(
            f"the {impl!r} {kernel} kernel compiles only on {COMPILES_ON[impl]}, not on "
            f"{platform!r}; pass interpret=True to run it in interpret mode (slow), or use "
            "implementation='reference'"
        )
    return impl, interpret
