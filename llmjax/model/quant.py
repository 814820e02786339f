"""Matmul weights packed for a backend: transposed, int8 (W8A8), or GGUF blocks kept quantized.

A `PackedWeight` stands in the parameter tree where a plain weight matrix would be. It holds the
matrix as [out, in] (an output channel per row, the layout of HF, GGUF and the fast narrow dot
kernels of XLA:CPU) in one of these formats (`FORMATS`):

    dense   values [out, in] in any float dtype (bf16 on CPU: XLA's bf16 dot is fast only with
            both operands contracting their last dim)
    int8    values int8 [out, in], scales f32 [out]; W = values * scales[:, None]. Activations
            are quantized per token at run time: W8A8 dynamic, int32 accumulation (`quantize`)
    int8_wo weight-only int8: values and scales as int8, activations stay float: y =
            (x @ values.T) * scales, the codes widened exactly and the sums in float32 (on CPU
            the dense kernel takes the int8 codes; elsewhere the dequantized matrix)
    int8_a16 W8A16: the int8_wo codes and scales, activations rounded to bfloat16 for the
            matmul: y = (bf16(x) @ values.T) * scales, products exact, sums in float32 (on CPU
            the dense kernel, on AMX tiles from 8 tokens on; elsewhere the dequantized matrix)
    q8_0    GGUF Q8_0: values int8 [out, in], scales f32 [out, in/32]; W = values * scale of its
            32-block
    q4_0    GGUF Q4_0: values uint8 [out, in/2], two 4-bit codes a byte, packed as GGUF packs a
            block: byte j of block b holds element 32b+j (low nibble) and 32b+16+j (high);
            W = (code - 8) * scale
    q4_1    GGUF Q4_1: packed as Q4_0; W = code * scale + min (mins f32 [out, in/32])

(+ a leading layers axis on every array in the stacked layout, llmjax/model/params.py.) Static
metadata records the plain weight's shape and how it is laid out (`plain_shape`, `out_first`:
the embedding [V, D] is [out, in]; every other matrix is [in..., out...]), so `dequantize` gives
back exactly the plain weight, and `PackedWeight.shape` is the plain shape.

`qdot(x, w)` is the one matmul of the model: x [T, in] @ W -> [T, out]. It picks the form per
backend with `lax.platform_dependent` (decided at lowering): on CPU the C++ kernels
(kernels_cpu/qmatmul.py) for the quantized formats, else XLA's int8 x int8 dot for int8 and a
[out, in]-contracting dot for dense (one-row batches padded to two rows: XLA:CPU widens narrow
weights to a materialized f32 copy for a single row); on GPU and TPU the dequantize-in-the-matmul
form (XLA fuses the dequantization into the dot's operand).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

FORMATS = ("dense", "int8", "int8_wo", "int8_a16", "q8_0", "q4_0", "q4_1")
WEIGHT_ONLY_INT8 = ("int8_wo", "int8_a16")  # int8 codes through the dense kernel, then scaled
BLOCK = 32  # the GGUF formats' block length along `in`

# Weight matrices of the parameter tree (llmjax/model/params.py) and how many of their leading
# plain axes are `in` (wo is [N, H, D]: two).
MATRICES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
# A mixture's experts ([E, in, out] plain, llmjax/model/moe.py): packed expert by expert into one
# PackedWeight whose leading (batch) axis is the experts, values [E, out, in] ([L, E, out, in]
# stacked by layer); llmjax/model/grouped_qdot.py multiplies them.
EXPERT_MATRICES = {"we_gate": 1, "we_up": 1, "we_down": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight matrix as [out, in] in one of FORMATS (see the module doc)."""

    values: Any
    scales: Any = None
    mins: Any = None
    layer: Any = None  # an int32 scalar: a view of that layer of stacked arrays (`at_layer`)
    fmt: str = dataclasses.field(default="dense", metadata=dict(static=True))
    plain_shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    in_ndim: int = dataclasses.field(default=1, metadata=dict(static=True))
    out_first: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading axes before [out, in] (the layers axis when stacked; none for a view of
        one layer)."""
        lead = tuple(np.shape(self.values)[:-2])
        return lead if self.layer is None else lead[1:]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.batch_shape + self.plain_shape

    @property
    def in_shape(self) -> tuple[int, ...]:
        p = self.plain_shape
        return p[len(p) - self.in_ndim :] if self.out_first else p[: self.in_ndim]

    @property
    def out_shape(self) -> tuple[int, ...]:
        p = self.plain_shape
        return p[: len(p) - self.in_ndim] if self.out_first else p[self.in_ndim :]

    @property
    def num_in(self) -> int:
        return math.prod(self.in_shape)

    @property
    def num_out(self) -> int:
        return math.prod(self.out_shape)

    @property
    def nbytes(self) -> int:
        return sum(
            int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize
            for a in (self.values, self.scales, self.mins)
            if a is not None
        )

    def __array__(self, dtype=None, copy=None):
        """`np.asarray(w)`: the plain weight (dequantized, float32 unless `dtype`), for code
        that reads weights as arrays (plots, calibration)."""
        xp = np if isinstance(self.values, np.ndarray) else jnp
        plain = np.asarray(dequantize(self.one_layer(), np.float32, xp))
        return plain if dtype is None else plain.astype(dtype)

    def at_layer(self, layer) -> PackedWeight:
        """A view of layer `layer` (an int32 scalar, may be traced) of a stacked weight (its
        first batch axis; an expert stack keeps its experts axis): the
        arrays stay whole, so a C++ kernel reads the layer in place (a `lax.scan` that sliced
        the stack would copy each layer's weights every step); other forms slice it."""
        if not self.batch_shape:
            raise ValueError("at_layer wants a layers axis; the weight has none")
        return dataclasses.replace(self, layer=layer)

    def one_layer(self) -> PackedWeight:
        """A view (`at_layer`) materialized as that layer's own arrays (a dynamic slice)."""
        if self.layer is None:
            return self
        take = lambda a: (
            None if a is None else jax.lax.dynamic_index_in_dim(a, self.layer, 0, False)
        )
        return dataclasses.replace(
            self,
            values=take(self.values),
            scales=take(self.scales),
            mins=take(self.mins),
            layer=None,
        )

    def __getitem__(self, index) -> PackedWeight:
        """Index the leading (layers) axes: `w[i]` is layer i's weight."""
        if not self.batch_shape:
            raise IndexError("a PackedWeight without a layers axis cannot be indexed")
        take = lambda a: None if a is None else a[index]
        return dataclasses.replace(
            self, values=take(self.values), scales=take(self.scales), mins=take(self.mins)
        )


def is_packed(x) -> bool:
    return isinstance(x, PackedWeight)


# ---- packing and quantizing (host side, numpy) ----------------------------------------------


def _as_out_in(w: np.ndarray, in_ndim: int, out_first: bool) -> np.ndarray:
    """A plain weight -> its [out, in] matrix."""
    if out_first:
        n_out = w.ndim - in_ndim
        return w.reshape(math.prod(w.shape[:n_out]), -1)
    return w.reshape(math.prod(w.shape[:in_ndim]), -1).T


def stack_packed(weights: list[PackedWeight]) -> PackedWeight:
    """PackedWeights of one format and shape -> one with a new leading batch axis (numpy
    arrays stay numpy)."""
    xp = np if isinstance(weights[0].values, np.ndarray) else jnp
    return jax.tree.map(lambda *a: xp.stack(a), *weights)


def pack_experts(w, pack, in_ndim: int = 1) -> PackedWeight:
    """A plain expert stack [E, *in, *out] -> `pack` of each expert, stacked (batch axis E)."""
    return stack_packed([pack(w[e], in_ndim, False) for e in range(np.shape(w)[0])])


def pack_dense(w, in_ndim: int = 1, out_first: bool = False) -> PackedWeight:
    """A plain float weight -> the dense format ([out, in], same dtype)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    m = _as_out_in(w, in_ndim, out_first)
    return PackedWeight(
        xp.ascontiguousarray(m) if xp is np else m,
        fmt="dense",
        plain_shape=tuple(w.shape),
        in_ndim=in_ndim,
        out_first=out_first,
    )


def quantize_int8(w, in_ndim: int = 1, out_first: bool = False, fmt: str = "int8") -> PackedWeight:
    """A plain float weight -> int8 per output channel, symmetric: scale = max|row| / 127
    (`fmt` 'int8': W8A8, 'int8_wo': weight-only, 'int8_a16': W8A16; the same codes and
    scales)."""
    m = np.asarray(_as_out_in(np.asarray(w, np.float32), in_ndim, out_first), np.float32)
    amax = np.abs(m).max(axis=1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(m / scales[:, None]), -127, 127).astype(np.int8)
    return PackedWeight(
        values,
        scales,
        fmt=fmt,
        plain_shape=tuple(np.shape(w)),
        in_ndim=in_ndim,
        out_first=out_first,
    )


GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # f16 scale [+ f16 min] + codes
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def from_gguf_blocks(data, fmt: str, plain_shape, in_ndim: int = 1, out_first: bool = False):
    """GGUF blocks as stored, uint8 [out, in/32 * block bytes] -> PackedWeight (codes, and the
    f16 scales/mins widened to f32, exactly)."""
    rows = data.shape[0]
    blocks = np.asarray(data, np.uint8).reshape(rows, -1, GGUF_BLOCK_BYTES[fmt])
    f16 = lambda b: np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)
    scales, mins = f16(blocks[..., 0:2]), None
    if fmt == "q4_1":
        mins, codes = f16(blocks[..., 2:4]), blocks[..., 4:]
    else:
        codes = blocks[..., 2:]
    values = np.ascontiguousarray(codes).reshape(rows, -1)
    if fmt == "q8_0":
        values = values.view(np.int8)
    return PackedWeight(
        values,
        scales,
        mins,
        fmt=fmt,
        plain_shape=tuple(plain_shape),
        in_ndim=in_ndim,
        out_first=out_first,
    )


def quantize_blocks(w, fmt: str, in_ndim: int = 1, out_first: bool = False) -> PackedWeight:
    """A plain float weight -> GGUF blocks (q8_0, q4_0, q4_1), quantized by the gguf package
    as llama.cpp's converter does (`in` must be a multiple of 32)."""
    import gguf

    m = np.ascontiguousarray(_as_out_in(np.asarray(w, np.float32), in_ndim, out_first))
    if m.shape[1] % BLOCK:
        raise ValueError(f"{fmt} needs in features % {BLOCK} == 0, the weight has {m.shape[1]}")
    data = gguf.quants.quantize(m, gguf.GGMLQuantizationType[GGUF_TYPES[fmt]])
    return from_gguf_blocks(data, fmt, np.shape(w), in_ndim, out_first)


def quantize_params(params, method: str):
    """Every weight matrix of a (list-layout) parameter tree packed by `method` ('int8':
    W8A16, per-channel int8 of the float weights with the matmuls' activations rounded to
    bfloat16, format 'int8_a16'; 'w8a8': the same weights, activations int8 per token, format
    'int8'; 'int8_wo': the same weights, weight-only;
    'q8_0', 'q4_0', 'q4_1': GGUF blocks, quantized as llama.cpp does; 'dense': transposed, same
    dtype). A mixture's experts are packed expert by expert (EXPERT_MATRICES). The tied
    embedding is packed too (it is also the LM head: lookups dequantize their rows), an untied
    embedding is not (a lookup reads one row; `lm_head` is packed instead). Norms and biases stay
    plain. Already packed weights (GGUF blocks) are kept.
    Under 'w8a8' the LM head is weight-only int8 ('int8_wo', the same codes): its input, the
    final norm's output, has outlier channels that per-token int8 rounds badly and that
    SmoothQuant cannot move into a tied embedding (llmjax/model/smooth.py). On SmolLM2 that
    took teacher-forced greedy agreement with float32 from .936 to .947 (smoothed layers), and
    it is no slower (the LM head runs only on the rows that sample)."""
    if method in GGUF_BLOCK_BYTES:
        pack = lambda w, in_ndim, out_first: quantize_blocks(w, method, in_ndim, out_first)
    else:
        pack = {
            "int8": lambda w, i, o: quantize_int8(w, i, o, fmt="int8_a16"),
            "w8a8": quantize_int8,
            "int8_wo": lambda w, i, o: quantize_int8(w, i, o, fmt="int8_wo"),
            "dense": pack_dense,
        }[method]
    if isinstance(params["layers"], dict):
        raise ValueError("quantize_params takes the list layout (stack the layers afterwards)")

    def one(w, in_ndim, out_first=False):
        return w if is_packed(w) else pack(w, in_ndim, out_first)

    def one_of(name, w):
        if name in MATRICES:
            return one(w, MATRICES[name])
        if name in EXPERT_MATRICES and not is_packed(w):
            return pack_experts(w, pack, EXPERT_MATRICES[name])
        return w

    out = dict(params)
    out["layers"] = [{k: one_of(k, v) for k, v in layer.items()} for layer in params["layers"]]
    if method == "w8a8":
        pack = lambda w, i, o: quantize_int8(w, i, o, fmt="int8_wo")  # the LM head (see above)
    if "lm_head" in params:
        out["lm_head"] = one(params["lm_head"], 1)
    else:
        out["embed"] = one(params["embed"], 1, out_first=True)
    return out


def _unpack_nibbles(values, xp):
    """uint8 [..., out, in/2] -> codes uint8 [..., out, in] (GGUF's within-block order)."""
    *lead, out, half = values.shape
    p = values.reshape(*lead, out, half // 16, 1, 16)
    codes = xp.concatenate([p & 0x0F, p >> 4], axis=-2)  # [..., out, nb, 2, 16]
    return codes.reshape(*lead, out, half * 2)


def dequantize_matrix(w: PackedWeight, dtype=jnp.float32, xp=jnp):
    """-> the [..., out, in] float32 matrix, computed as gguf.quants.dequantize does (numpy:
    bit-exact with it), then cast to `dtype`."""
    v = w.values
    if w.fmt == "dense":
        return v.astype(dtype)
    if w.fmt in ("int8", *WEIGHT_ONLY_INT8):
        return (v.astype(xp.float32) * w.scales[..., None]).astype(dtype)
    *lead, out = v.shape[:-1]
    if w.fmt == "q8_0":
        n = v.shape[-1]
        blocks = v.reshape(*lead, out, n // BLOCK, BLOCK).astype(xp.float32)
        m = blocks * w.scales[..., None]
    else:
        codes = _unpack_nibbles(v, xp)
        n = codes.shape[-1]
        codes = codes.reshape(*lead, out, n // BLOCK, BLOCK)
        if w.fmt == "q4_0":
            m = w.scales[..., None] * (codes.astype(xp.int8) - xp.int8(8)).astype(xp.float32)
        elif w.fmt == "q4_1":
            m = (w.scales[..., None] * codes.astype(xp.float32)) + w.mins[..., None]
        else:
            raise ValueError(f"unknown packed weight format {w.fmt!r}; choose one of {FORMATS}")
    return m.reshape(*lead, out, n).astype(dtype)


def dequantize(w: PackedWeight, dtype=jnp.float32, xp=jnp):
    """-> the plain weight (`w.shape`, e.g. wq's [D, N, H]) in `dtype`."""
    m = dequantize_matrix(w, dtype, xp)
    lead = w.batch_shape
    if w.out_first:
        return m.reshape(*lead, *w.plain_shape)
    m = xp.swapaxes(m, -1, -2)  # [..., in, out]
    return m.reshape(*lead, *w.plain_shape)


def unpack_params(params, dtype=jnp.float32):
    """Every PackedWeight of a tree dequantized to its plain weight (numpy stays numpy)."""

    def one(x):
        if not is_packed(x):
            return x
        xp = np if isinstance(x.values, np.ndarray) else jnp
        return dequantize(x, dtype, xp)

    return jax.tree.map(one, params, is_leaf=is_packed)


def weight_bytes(params) -> int:
    """Bytes the weights occupy (packed weights as packed)."""
    total = 0
    for leaf in jax.tree.leaves(params, is_leaf=is_packed):
        if is_packed(leaf):
            total += leaf.nbytes
        else:
            total += int(np.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
    return total


# ---- the matmul ---------------------------------------------------------------------------------


def _pad_one_row(x):
    """[1, in] -> [2, in] (XLA:CPU runs narrow dots on its fast kernels from two rows)."""
    return jnp.concatenate([x, jnp.zeros_like(x)]) if x.shape[0] == 1 else x


def quantize_rows_int8(x):
    """Per-token symmetric int8: x [T, in] -> (xq int8 [T, in], sx f32 [T]); a zero row's scale
    is 1. Rounds half to even."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=1)
    sx = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x32 / sx[:, None]), -127, 127).astype(jnp.int8)
    return xq, sx


def int8_dot_xla(x, w: PackedWeight):
    """W8A8 with XLA's int8 x int8 -> int32 dot (weights [out, in], contracting both last)."""
    T = x.shape[0]
    xq, sx = quantize_rows_int8(x)
    acc = jax.lax.dot_general(
        _pad_one_row(xq), w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
    )[:T]
    return acc.astype(jnp.float32) * sx[:, None] * w.scales[None, :]


def dense_dot_xla(x, w, scales=None, widen: bool = False):
    """x @ w.T with XLA's dot, w [out, in] (a dense PackedWeight or its values); `widen`: the
    values widened to x's dtype first (int8 codes, or bfloat16 weights for a float32 GEMM);
    `scales`: per-output factors of the result (weight-only int8)."""
    T = x.shape[0]
    values = w.values if is_packed(w) else w
    if widen:
        values = values.astype(x.dtype)
    y = jax.lax.dot_general(
        _pad_one_row(x.astype(values.dtype)),
        values,
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y[:T] if scales is None else y[:T] * scales[None, :]


def dequantized_dot(x, w: PackedWeight):
    """The dequantize-in-the-matmul form (GPU, TPU; and the CPU fallback for GGUF blocks).
    'int8_a16' rounds x to bfloat16 first (its definition; the products are then exact)."""
    w = w.one_layer()
    if w.fmt == "int8_a16":
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    m = dequantize_matrix(w, x.dtype)
    return jax.lax.dot_general(
        x, m, (((1,), (w.values.ndim - 1,)), ((), ())), preferred_element_type=jnp.float32
    )


def _cpu_kernel(vectorized: bool = True):
    """kernels_cpu.qmatmul when the C++ kernels build here with a vector engine (else None);
    `vectorized=False`: with any engine, the portable scalar one included."""
    try:
        from kernels_cpu import build
        from kernels_cpu.qmatmul import qmatmul
    except ImportError:
        return None
    usable = build.vectorized("qmatmul") if vectorized else build.available()
    return qmatmul if usable else None


CPU_KERNEL_FORMATS = ("int8", "q8_0", "q4_0", "q4_1")
# Dense float32 weights take the C++ kernel (kernels_cpu/dense_matmul.py) up to this many tokens,
# XLA's dot above (where its GEMM is faster: scripts/bench_dense_matmul.py). bfloat16 weights take
# it at every size: its AMX path is as fast as XLA's oneDNN dot at prefill sizes (609 vs 634 us
# for [576, 1536] at T = 512) and reads a scanned layer in place, where XLA's dot needs the layer
# sliced out of the stacked weights first (22 ms of copies per 512-token bf16 step).
DENSE_KERNEL_MAX_TOKENS = 64
# The kernel's AVX2 engine (a CPU without AVX-512) wins over XLA's dot only in a narrower range
# (2-core AMD EPYC, [576, 1536] and [1536, 576], weights cold): to 32 tokens (16: 390-410
# against 550-700 us; 40-48 about even; 64: 1520 against 1160). At one token XLA's dot alone
# streams a little faster (151 against 180 us), but not in the model: there the one row is
# padded to two (`_pad_one_row`, 446 us), and a scanned layer loop slices each layer's weights
# out for it (SmolLM2 float32 at batch 1: 83 ms a token with XLA's dot, 33 with the kernel).
# bfloat16 likewise from 1 token (XLA widens the weight: 1796 against 109 us).
AVX2_DENSE_KERNEL_TOKENS = {
    jnp.dtype(jnp.float32): (1, 32),
    jnp.dtype(jnp.bfloat16): (1, 32),
    jnp.dtype(jnp.int8): (1, 32),
}
# Above the kernel's range on the AVX2 engine (no bf16 dot instructions), bfloat16 weights are
# widened to float32 in the step from this many tokens on, for XLA's float32 GEMM: at 512 tokens
# 6.6 ms for [576, 1536] against 8.6 for XLA's bf16 dot (the widening itself ~1.5 ms, so at 128
# tokens it loses: 3.1 against 2.2; scripts/bench_dense_matmul.py --impls xla_bf16_f32_oi).
AVX2_BF16_WIDEN_TOKENS = 256
# int8 weights likewise (scripts/bench_qmatmul.py: the kernel wins to ~64 tokens); the GGUF block
# formats take the kernel at every size (XLA has no form for them but dequantizing).
INT8_KERNEL_MAX_TOKENS = 64
# Where the kernels have only their portable scalar loops (a CPU without AVX-512: kernels_cpu/
# build.py's `engines()`), XLA's dot is 3-25x faster at every size but one: int8 weights at one
# token (W8A8 decode at batch 1: 102 us for [576, 1536] against 488 for XLA's int8 dot, measured
# on a 2-core AMD EPYC with AVX2, scripts/bench_qmatmul.py).
PORTABLE_INT8_MAX_TOKENS = 1


def _cpu_dense_kernel():
    """kernels_cpu.dense_matmul when the C++ kernels build here with a vector engine (their
    portable loops lose to XLA's dot at every size), else None."""
    try:
        from kernels_cpu import build
        from kernels_cpu.dense_matmul import dense_matmul
    except ImportError:
        return None
    return dense_matmul if build.vectorized("dense_matmul") else None


def dense_kernel_tokens(dtype) -> tuple[int, int]:
    """The token counts (lo, hi) at which dense weights of `dtype` take the C++ kernel on this
    CPU ((1, 0): never), by the engine it was compiled with (see DENSE_KERNEL_MAX_TOKENS)."""
    dtype = jnp.dtype(dtype)
    if dtype not in AVX2_DENSE_KERNEL_TOKENS or _cpu_dense_kernel() is None:
        return (1, 0)
    from kernels_cpu import build

    if build.engines()["dense_matmul"] == "avx2":
        return AVX2_DENSE_KERNEL_TOKENS[dtype]
    return (1, 1 << 62 if dtype == jnp.bfloat16 else DENSE_KERNEL_MAX_TOKENS)


def _widen_bf16(dtype, T: int) -> bool:
    """Whether bfloat16 weights run as float32 at T tokens (AVX2_BF16_WIDEN_TOKENS)."""
    if jnp.dtype(dtype) != jnp.bfloat16 or T < AVX2_BF16_WIDEN_TOKENS:
        return False
    if _cpu_dense_kernel() is None:
        return False
    from kernels_cpu import build

    return build.engines()["dense_matmul"] == "avx2"


def dense_kernel_for(dtype, T: int, fmt: str = "dense"):
    """kernels_cpu.dense_matmul where it takes T tokens of weights of `dtype` on this CPU
    (`dense_kernel_tokens`), else None. 'int8_a16' (int8 codes, bfloat16 x) takes it at every
    size where the kernel has its AMX engine (which multiplies them on the tiles, as bfloat16
    weights), else int8's range."""
    lo, hi = dense_kernel_tokens(dtype)
    if fmt == "int8_a16" and hi > 0:
        from kernels_cpu import build

        if build.engines()["dense_matmul"] == "amx":
            hi = 1 << 62
    return _cpu_dense_kernel() if lo <= T <= hi else None


def qmatmul_kernel_for(fmt: str, T: int):
    """kernels_cpu.qmatmul where it beats XLA's form of `fmt` at T tokens on this CPU, else
    None: the GGUF blocks at every size, int8 up to INT8_KERNEL_MAX_TOKENS (and on the portable
    engine up to PORTABLE_INT8_MAX_TOKENS)."""
    kernel = _cpu_kernel() if fmt in CPU_KERNEL_FORMATS else None
    if fmt == "int8" and T > INT8_KERNEL_MAX_TOKENS:
        return None  # XLA's int8 GEMM (oneDNN) is faster at prefill sizes
    if kernel is None and fmt == "int8" and T <= PORTABLE_INT8_MAX_TOKENS:
        return _cpu_kernel(vectorized=False)
    return kernel


def cpu_dot(x, w: PackedWeight):
    if w.fmt in ("dense", *WEIGHT_ONLY_INT8):  # the dense kernel (int8: codes, then scaled)
        wo = w.fmt in WEIGHT_ONLY_INT8
        kernel = dense_kernel_for(w.values.dtype, x.shape[0], w.fmt)
        if kernel is not None:
            xk = x.astype(jnp.float32 if wo else w.values.dtype)
            try:
                y = kernel(xk, w.values, layer=w.layer, round_x=w.fmt == "int8_a16")
                if not wo:
                    return y
                return y * (w.scales if w.layer is None else w.scales[w.layer])[None, :]
            except ValueError as e:  # a shape the kernel does not take (checked while tracing)
                logger.debug("dense kernel refused %s: %s; XLA's dot instead", w.shape, e)
        if wo or _widen_bf16(w.values.dtype, x.shape[0]):  # XLA's f32 GEMM, values widened
            w = w.one_layer()
            if w.fmt == "int8_a16":  # its definition (the kernel rounds x itself: round_x)
                x = x.astype(jnp.bfloat16)
            return dense_dot_xla(x.astype(jnp.float32), w.values, scales=w.scales, widen=True)
    kernel = qmatmul_kernel_for(w.fmt, x.shape[0])
    if kernel is not None:
        try:
            return kernel(x, w.values, w.scales, w.mins, fmt=w.fmt, layer=w.layer)
        except ValueError as e:  # a shape the kernel does not take (checked while tracing)
            logger.debug("qmatmul kernel refused %s %s: %s; XLA's form instead", w.fmt, w.shape, e)
    w = w.one_layer()
    if w.fmt == "int8":
        return int8_dot_xla(x, w)
    if w.fmt == "dense":
        return dense_dot_xla(x, w)
    return dequantized_dot(x, w)


def qdot(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """x [T, in] @ w -> [T, out] in `out_dtype` (x's dtype by default). `w` is a PackedWeight
    (its [out, in] matrix; the form chosen per backend, see the module doc) or a plain [in, out]
    matrix (`x @ w`)."""
    out_dtype = out_dtype or x.dtype
    if not is_packed(w):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    if w.batch_shape:
        raise ValueError(f"qdot takes one layer's weight, got batch shape {w.batch_shape}")
    if x.shape[-1] != w.num_in:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.num_in}")
    y = jax.lax.platform_dependent(x, w, cpu=cpu_dot, default=dequantized_dot)
    return y.astype(out_dtype)


def linear(x: jax.Array, w) -> jax.Array:
    """x [T, *in] @ a weight (plain [*in, *out] with `in` given by x's trailing dims after T, or
    packed) -> [T, *out]."""
    T = x.shape[0]
    x2 = x.reshape(T, -1)
    if is_packed(w):
        return qdot(x2, w).reshape(T, *w.out_shape)
    n_in = x.ndim - 1
    out_shape = w.shape[n_in:]
    return (x2 @ w.reshape(x2.shape[1], -1)).reshape(T, *out_shape)


def take_rows(embed, ids: jax.Array) -> jax.Array:
    """Embedding lookup: rows `ids` of a plain [V, D] table, or of a packed (out-first) one,
    dequantized (float32 for quantized formats, the table's dtype for dense)."""
    if not is_packed(embed):
        return embed[ids]
    if not embed.out_first:
        raise ValueError("an embedding table is packed out-first ([V, D])")
    rows = dataclasses.replace(
        embed,
        values=embed.values[ids],
        scales=None if embed.scales is None else embed.scales[ids],
        mins=None if embed.mins is None else embed.mins[ids],
    )
    dtype = embed.values.dtype if embed.fmt == "dense" else jnp.float32
    return dequantize_matrix(rows, dtype)
