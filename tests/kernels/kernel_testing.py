"""Shared by the kernel tests: the per-dtype comparison with a reference, and exporting a kernel
for cuda on a CPU-only machine.

Tolerances: float32 2e-5 absolute (only the summation order differs from the reference);
bfloat16 2e-2 x max|ref| (both sides round the output to bf16, one step is 2^-8 relative, and the
kernels round the softmax weights to bf16 before p @ v, as flash kernels do).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(jnp.bfloat16): 2e-2}  # bf16: x max|ref|
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"


@pytest.fixture
def reset_mgpu_interpreter():
    """After the test, reset Mosaic GPU's interpreter: a failed interpreted kernel leaves its
    state behind (its docstring says to reset before the next kernel). Use it in a test module
    with `pytestmark = pytest.mark.usefixtures("reset_mgpu_interpreter")` and
    `from tests.kernels.kernel_testing import reset_mgpu_interpreter  # noqa: F401`."""
    yield
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        reset_gpu_interpret_mode_state,
    )

    reset_gpu_interpret_mode_state()


def assert_matches_reference(out, ref) -> None:
    tol = TOLERANCE[np.dtype(ref.dtype)]
    if ref.dtype == jnp.bfloat16:
        tol *= float(np.abs(np.asarray(ref, np.float32)).max())
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert np.isfinite(out32).all()
    np.testing.assert_allclose(out32, ref32, rtol=0, atol=tol)


def export_for_cuda(fn, args, custom_call: str = TRITON_CALL) -> jax.export.Exported:
    """Export jitted `fn` for cuda under an abstract H200 mesh (the Pallas GPU lowerings run
    without a GPU) and check that it holds the kernel's custom call (Triton's, or Mosaic GPU's:
    its lowering runs layout inference and checks tile shapes and the SMEM size for sm_90)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        # Under jit the kernel is lowered here, outside the kernel wrapper's own warning filter.
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        exported = jax.export.export(
            fn,
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(custom_call)],
        )(*args)
    targets = set(re.findall(r"custom_call @([A-Za-z0-9_$.]+)", exported.mlir_module()))
    assert custom_call in targets, targets
    return exported


def mixed_steps_logits(
    attention_fn, a: list[int], b: list[int], config=None, dtype=jnp.bfloat16, stacked=False
) -> np.ndarray:
    """The `dtype` model's logits (every row; default the tiny-h64 preset in bfloat16) over two
    mixed steps with `attention_fn`: a prefill chunk of `a` beside the whole prompt `b` but its
    last token, then the rest of `a` (8 tokens) beside `b`'s last token as a decode, on shuffled
    pages; `stacked`: the layers scanned. Backends agree on these logits where greedy tokens of a
    random model could hide an attention bug."""
    import configs
    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.llama import forward
    from llmjax.model.params import init_params, stack_layers
    from tests.helpers import make_step

    config = config or configs.get_preset("tiny-h64")
    params = jax.tree.map(lambda x: x.astype(dtype), init_params(config, jax.random.key(0)))
    if stacked:
        params = stack_layers(params)
    G, table_a, table_b = 16, [5, 2, 7], [3, 9, 1]
    steps = [
        make_step([(a[:-8], 0, table_a), (b[:-1], 0, table_b)], G, all_logits=True),
        make_step(
            [(a[-8:], len(a) - 8, table_a), (b[-1:], len(b) - 1, table_b)], G, all_logits=True
        ),
    ]
    kv = allocate_kv_pages(config, 12, G, dtype, stacked=stacked)
    out = []
    for step in steps:
        step = jax.tree.map(jnp.asarray, step)  # device arrays, as the engine's jitted step has
        logits, kv = forward(params, kv, step, config, attention_fn)
        out.append(np.asarray(logits))
    return np.concatenate(out)


def no_cpu_compiler() -> bool:
    """Whether the CPU kernel tests skip: only where there is nothing to build with (or the
    kernels are turned off, LLMJAX_CPU_KERNELS=0); where a compiler is, a kernel that fails to
    build fails the tests instead of skipping them."""
    import os

    from kernels_cpu.build import KernelsUnavailable, _compiler

    if os.environ.get("LLMJAX_CPU_KERNELS", "1") == "0":
        return True
    try:
        _compiler()
    except KernelsUnavailable:
        return True
    return False
