"""The grouped matmul (kernels_pallas/grouped_matmul) against its specification, ragged_dot, on
random cases: uneven groups, empty groups, one group holding every row, rows past the last
group, one row; float32 and bfloat16. The tiled CPU loop and megablox's TPU kernel (interpreted
here) each in one test class; the specification against a float64 loop; the TPU kernel exported
for TPU and the GPU's ragged_dot for cuda."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import grouped_matmul, grouped_matmul_reference
from tests.kernels.kernel_testing import TOLERANCE

# (M, K, N, G, sizes): sizes 'random' (uneven, some empty), 'one' (group 2 takes every row),
# 'short' (the groups hold M - 3 rows: the rest give zeros), 'sparse' (2 of G groups used).
CASES = [
    (13, 32, 48, 8, "random"),
    (1, 16, 8, 4, "random"),
    (40, 64, 24, 6, "one"),
    (21, 16, 32, 5, "short"),
    (70, 32, 16, 16, "sparse"),
    (130, 128, 256, 4, "random"),  # more than one row tile on the CPU and on TPU
]


def make_case(M, K, N, G, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed + M * 7 + G)
    rows = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dtype)
    if sizes == "one":
        counts = np.zeros(G, int)
        counts[2] = M
    elif sizes == "sparse":
        counts = np.zeros(G, int)
        counts[[3, G - 1]] = [M // 3, M - M // 3]
    else:
        total = M - 3 if sizes == "short" else M
        counts = np.bincount(rng.integers(0, G, total), minlength=G)
    return rows, w, jnp.asarray(counts, jnp.int32)


def _check(out, ref):
    tol = TOLERANCE[np.dtype(jnp.bfloat16 if ref.dtype == jnp.bfloat16 else np.float32)]
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * max(1.0, np.abs(ref).max()))


class TestTiled:
    IMPLEMENTATION = "tiled"

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    @pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
    def test_matches_reference(self, case, dtype):
        rows, w, sizes = make_case(*case, dtype)
        ref = grouped_matmul_reference(rows, w, sizes)
        out = jax.jit(lambda r, w, s: grouped_matmul(r, w, s, implementation=self.IMPLEMENTATION))(
            rows, w, sizes
        )
        assert out.dtype == jnp.float32
        _check(out, ref)
        if case[-1] == "short":
            assert not np.asarray(out[-3:]).any()  # rows past the groups are zeros


class TestTpuInterpret(TestTiled):
    IMPLEMENTATION = "tpu"  # megablox's kernel, interpreted on the CPU


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "-".join(map(str, c)))
def test_reference_matches_a_float64_loop(case):
    rows, w, sizes = make_case(*case, jnp.float32)
    x, m = np.asarray(rows, np.float64), np.asarray(w, np.float64)
    want = np.zeros((x.shape[0], m.shape[2]))
    start = 0
    for g, n in enumerate(np.asarray(sizes)):
        want[start : start + n] = x[start : start + n] @ m[g]
        start += n
    np.testing.assert_allclose(grouped_matmul_reference(rows, w, sizes), want, atol=1e-4)


def test_wrapper_checks_and_defaults():
    from kernels_pallas.grouped_matmul import default_implementation

    assert default_implementation("cpu") == "tiled" and default_implementation("tpu") == "tpu"
    assert default_implementation("cuda") == "reference"
    rows, w, sizes = make_case(5, 8, 4, 3, "random", jnp.float32)
    with pytest.raises(ValueError, match=r"w\.shape"):
        grouped_matmul(rows, w[:, :4], sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(rows, w, sizes[:2])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        grouped_matmul(rows.astype(jnp.float16), w, sizes)
    with pytest.raises(ValueError, match="implementation"):
        grouped_matmul(rows, w, sizes, implementation="cuda")
    assert grouped_matmul(rows[:0], w, sizes * 0).shape == (0, 4)


@pytest.mark.parametrize("M, K, N, G", [(16, 1024, 2048, 8), (300, 1024, 256, 64)])
def test_exports_for_tpu_and_cuda(M, K, N, G):
    """The engine's shapes (Mixtral- and Qwen3-MoE-like) lower for TPU (megablox's Mosaic
    kernel) and for cuda (XLA's ragged_dot, no custom call needed)."""
    args = (
        jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16),
        jax.ShapeDtypeStruct((G,), jnp.int32),
    )
    tpu = jax.jit(lambda *a: grouped_matmul(*a, implementation="tpu", interpret=False))
    assert "tpu_custom_call" in jax.export.export(tpu, platforms=["tpu"])(*args).mlir_module()
    gpu = jax.jit(lambda *a: grouped_matmul(*a, implementation="reference"))
    assert "ragged_dot" in jax.export.export(gpu, platforms=["cuda"])(*args).mlir_module()
