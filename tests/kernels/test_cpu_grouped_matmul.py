"""The CPU grouped matmuls (kernels_cpu: grouped_dense_matmul, grouped_qmatmul), the form a
mixture of experts runs its projections in, against their specification.

Each group's rows are one product with that group's matrix, so a row's result must equal, bit
for bit, the ungrouped kernel's on the same block of rows (whose own accuracy the dense and
qmatmul tests bound against float64); the dense form is also checked against the float64
reference within the dense tests' bounds and against `jax.lax.ragged_dot`. Group sizes cover empty
groups, one group holding every row, rows past the groups (zeros), sizes reaching past M (cut),
negative sizes (0), and a stacked [L, G, ...] weight read in place by a `lax.scan` over layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu.dense_matmul import (
    dense_matmul,
    grouped_dense_matmul,
    grouped_dense_matmul_reference,
)
from kernels_cpu.qmatmul import FORMATS, grouped_qmatmul, grouped_qmatmul_reference, qmatmul
from tests.kernels.kernel_testing import no_cpu_compiler
from tests.kernels.test_cpu_dense_matmul import _stack_copies, check, random_inputs
from tests.kernels.test_cpu_qmatmul import make_weights

pytestmark = pytest.mark.skipif(
    no_cpu_compiler(), reason="no C++ compiler (or LLMJAX_CPU_KERNELS=0)"
)

# (M, group sizes): uneven, empty groups, one group with every row, rows past the groups, a
# group reaching past M, a negative size.
GROUPS = {
    "uneven": (40, [3, 0, 17, 1, 0, 19]),
    "one-holds-all": (9, [0, 0, 9, 0, 0, 0]),
    "decode": (2, [0, 1, 0, 0, 1, 0]),
    "rows-past": (12, [2, 0, 3, 0, 0, 1]),
    "past-m": (10, [4, 0, 0, 20, 1, 1]),
    "negative": (8, [3, -2, 5, 0, 0, 0]),
}


def blocks(M: int, sizes):
    """(group, start, end) of each group's rows as the kernels cut them."""
    start = 0
    for g, s in enumerate(sizes):
        end = min(start + max(s, 0), M)
        yield g, start, end
        start = end


@pytest.mark.parametrize(
    "w_dtype", [jnp.float32, jnp.bfloat16, jnp.int8], ids=["f32", "bf16", "i8"]
)
@pytest.mark.parametrize("case", list(GROUPS))
def test_grouped_dense_equals_one_product_per_group(case, w_dtype):
    M, sizes = GROUPS[case]
    G, n_in, out = len(sizes), 96, 40
    rng = np.random.default_rng(len(case))
    x, _ = random_inputs(rng, M, n_in, out, w_dtype, jnp.float32)
    w = jnp.stack([random_inputs(rng, 1, n_in, out, w_dtype, jnp.float32)[1] for _ in range(G)])
    sizes = jnp.asarray(sizes, jnp.int32)
    y = np.asarray(jax.jit(grouped_dense_matmul)(x, w, sizes))
    assert y.shape == (M, out) and y.dtype == np.float32
    end = 0
    for g, start, end in blocks(M, sizes.tolist()):
        if end > start:
            np.testing.assert_array_equal(y[start:end], dense_matmul(x[start:end], w[g]))
            check(y[start:end], x[start:end], w[g])
    assert (y[end:] == 0).all()
    ref = grouped_dense_matmul_reference(x, w, sizes)
    mag = grouped_dense_matmul_reference(jnp.abs(x), jnp.abs(w.astype(jnp.float32)), sizes)
    assert (np.abs(y - ref) <= 1e-5 * mag + 1e-30).all()
    if w_dtype == jnp.float32 and (sizes >= 0).all() and int(sizes.sum()) <= M:
        spec = jax.lax.ragged_dot(x, w.transpose(0, 2, 1), sizes)  # the MoE layer's reference
        np.testing.assert_allclose(y, spec, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_grouped_dense_bfloat16_rows_and_a_stacked_scan():
    """bfloat16 rows; a lax.scan over layers passing the [L, G, out, in] stack and the index reads
    each layer's experts in place (no slice or copy of the stack) and equals one call per layer."""
    rng = np.random.default_rng(3)
    L, G, M, n_in, out = 3, 4, 7, 64, 48
    w = jnp.asarray(rng.standard_normal((L, G, out, n_in)).astype(np.float32), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((M, n_in)).astype(np.float32), jnp.bfloat16)
    sizes = jnp.asarray([2, 0, 4, 1], jnp.int32)

    def scanned(x, w, sizes):
        body = lambda i, _: (i + 1, grouped_dense_matmul(x, w, sizes, layer=i))
        return jax.lax.scan(body, 0, None, length=L)[1]

    got = jax.jit(scanned)(x, w, sizes)
    for i in range(L):
        np.testing.assert_array_equal(got[i], grouped_dense_matmul(x, w[i], sizes))
    hlo = jax.jit(scanned).lower(x, w, sizes).compile().as_text()
    assert "dynamic-slice" not in hlo and "dynamic_slice" not in hlo
    stack_shape = f"bf16[{L},{G},{out},{n_in}]"
    assert stack_shape in hlo and not _stack_copies(hlo, stack_shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["uneven", "decode", "past-m"])
def test_grouped_qmatmul_equals_one_product_per_group(case, fmt):
    M, sizes = GROUPS[case]
    G, n_in, out = len(sizes), 128, 64
    rng = np.random.default_rng(7)
    mats = [make_weights(rng, fmt, out, n_in) for _ in range(G)]
    values, scales = (np.stack([m[i] for m in mats]) for i in (0, 1))
    mins = None if fmt != "q4_1" else np.stack([m[2] for m in mats])
    x = jnp.asarray(rng.standard_normal((M, n_in)).astype(np.float32) * 2)
    sizes = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda x, v, s, m, gs: grouped_qmatmul(x, v, s, m, group_sizes=gs, fmt=fmt))
    y = np.asarray(f(x, values, scales, mins, sizes))
    end = 0
    for g, start, end in blocks(M, sizes.tolist()):
        if end > start:
            m = None if mins is None else mins[g]
            one = qmatmul(x[start:end], values[g], scales[g], m, fmt=fmt)
            np.testing.assert_array_equal(y[start:end], one)
    assert (y[end:] == 0).all()
    ref = grouped_qmatmul_reference(x, values, scales, mins, sizes, fmt)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_grouped_qmatmul_stacked_layers():
    rng = np.random.default_rng(11)
    L, G, M, n_in, out, fmt = 2, 3, 5, 64, 32, "q4_0"
    mats = [[make_weights(rng, fmt, out, n_in) for _ in range(G)] for _ in range(L)]
    values, scales = (np.stack([np.stack([m[i] for m in ms]) for ms in mats]) for i in (0, 1))
    x = jnp.asarray(rng.standard_normal((M, n_in)).astype(np.float32))
    sizes = jnp.asarray([1, 3, 1], jnp.int32)
    f = jax.jit(lambda x, v, s, i: grouped_qmatmul(x, v, s, group_sizes=sizes, fmt=fmt, layer=i))
    for i in (-1, 0, 1, 5):
        want = grouped_qmatmul(
            x,
            values[min(max(i, 0), L - 1)],
            scales[min(max(i, 0), L - 1)],
            group_sizes=sizes,
            fmt=fmt,
        )
        np.testing.assert_array_equal(f(x, values, scales, jnp.int32(i)), want)


def test_bad_inputs_name_what_is_wrong():
    x = jnp.ones((4, 64), jnp.float32)
    w = jnp.ones((3, 32, 64), jnp.float32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_dense_matmul(x, w, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="want w"):
        grouped_dense_matmul(x, w[0], jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="in=64"):
        grouped_dense_matmul(x, jnp.ones((3, 32, 65)), jnp.ones((3,), jnp.int32))
    values = jnp.ones((3, 32, 64), jnp.int8)
    scales = jnp.ones((3, 32, 2), jnp.float32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_qmatmul(x, values, scales, group_sizes=jnp.ones((4,), jnp.int32), fmt="q8_0")
    with pytest.raises(ValueError, match="scales"):
        grouped_qmatmul(
            x, values, scales[:, :, :1], group_sizes=jnp.ones((3,), jnp.int32), fmt="q8_0"
        )
