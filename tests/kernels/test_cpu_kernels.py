"""The C++ CPU kernels (kernels_cpu/) against their jnp specifications on random ragged inputs, the
engine on the 'cpu' attention backend against 'reference', and the fallback without them.

Tolerances as the other kernels' (tests/kernels/kernel_testing.py): float32 2e-5 absolute (only
the summation order, the online softmax's rescaling and the vectorized exponential, ~2e-7
relative, differ from the reference), bfloat16 2e-2 x max|ref| (both sides round the output to
bf16)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_pallas.ragged_paged_attention.cases import RAGGED_CASES, make_case
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.kernel_testing import no_cpu_compiler

pytestmark = pytest.mark.skipif(
    no_cpu_compiler(), reason="no C++ compiler (or LLMJAX_CPU_KERNELS=0)"
)


def test_the_kernels_build_and_load():
    assert os.path.exists(kernels_cpu.load())  # raises with the compiler's errors otherwise
    assert kernels_cpu.available()


def test_a_failing_compiler_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    """The sources compile in parallel, one process each: a compiler that fails raises
    KernelsUnavailable with its errors, and no library (nor a half-written one) is left."""
    from kernels_cpu import build

    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho "cxx: no $*" >&2\nexit 1\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(build.KernelsUnavailable, match="compiling the CPU kernels failed"):
        build.build()
    left = [f for _, _, files in os.walk(tmp_path / "cache") for f in files if f != ".lock"]
    assert left == []


def test_the_engines_compiled_follow_the_cpu_and_decide_the_models_matmul():
    """The kernels report the engine -march=native gave them (portable without AVX-512; the
    attention's int8 scores with VNNI), and the model takes the matmuls only with a vector
    engine (their scalar loops lose to XLA's dot)."""
    from kernels_cpu import build
    from llmjax.model import quant

    engines = build.engines()
    assert set(engines) == set(build.ENGINES)
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    for kernel, (_, names) in build.ENGINES.items():
        assert engines[kernel] in names
        assert engines[kernel].startswith(("avx512", "amx")) == ("avx512f" in flags), engines
    avx2 = "avx512f" not in flags and {"avx2", "fma"} <= set(flags)
    assert (engines["dense_matmul"] == "avx2") == avx2, engines
    assert (engines["qmatmul"] == "portable") == ("avx512f" not in flags), engines
    vnni = "avx512f" in flags and {"avx512_vnni", "avx512bw"} <= set(flags)
    assert (engines["ragged_paged_attention"] == "avx512_vnni") == vnni, engines
    assert (quant._cpu_dense_kernel() is not None) == build.vectorized("dense_matmul")
    assert (quant._cpu_kernel() is not None) == build.vectorized("qmatmul")
    assert quant._cpu_kernel(vectorized=False) is not None


TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def check(case, *, sliding_window=None, soft_cap=None, pages=None):
    H = case.q.shape[-1]
    kw = dict(sm_scale=H**-0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    args = case.args if pages is None else (case.q, *pages, *case.args[3:])
    out = jax.jit(lambda *a: kernels_cpu.ragged_paged_attention(*a, **kw))(*args)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ragged_paged_attention_reference(*case.args, **kw).astype(jnp.float32))
    assert np.isfinite(out).all()
    scale = 1.0 if case.q.dtype == np.float32 else np.abs(ref).max()
    err = np.abs(out - ref).max()
    assert err <= TOL[jnp.dtype(case.q.dtype).name] * scale, f"max error {err}"
    valid = int(case.cu_q_lens[case.num_seqs[0]])
    assert (out[valid:] == 0).all(), "padding rows must be 0"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_ragged_cases(name, dtype):
    q_lens, kv_lens, page_size = RAGGED_CASES[name]
    check(make_case(q_lens, kv_lens, page_size=page_size, dtype=jnp.dtype(dtype)))


@pytest.mark.parametrize(
    "num_kv_heads, num_queries_per_kv, head_dim",
    [(4, 1, 64), (2, 8, 64), (1, 4, 128), (3, 3, 64), (2, 2, 16), (2, 2, 40)],
    ids=["mha", "gqa8", "gqa4_h128", "smollm2_like", "tiny", "h40_not_16x"],
)
def test_gqa_and_head_dims(num_kv_heads, num_queries_per_kv, head_dim):
    q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
    kw = dict(num_kv_heads=num_kv_heads, num_queries_per_kv=num_queries_per_kv)
    check(make_case(q_lens, kv_lens, page_size=page_size, head_dim=head_dim, seed=1, **kw))


@pytest.mark.parametrize(
    "sliding_window, soft_cap", [(8, None), (None, 2.0), (5, 3.0)], ids=["window", "cap", "both"]
)
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
    case = make_case(q_lens, kv_lens, page_size=page_size, seed=2)
    check(case, sliding_window=sliding_window, soft_cap=soft_cap)


def test_padding_long_contexts_and_many_rows():
    check(make_case([1, 9, 3], [20, 9, 40], num_tokens=32, max_num_seqs=8, seed=3))
    check(make_case([1] * 24, list(range(100, 2500, 100)), page_size=16, seed=4))
    check(make_case([96, 1, 33], [300, 700, 33], seed=5, dtype=jnp.bfloat16))


# The tiled AVX-512 path (H % 16 == 0): tiles of up to 16 query vectors per kv head (a chunk's
# rows x Q, or a decode's Q; heads in parts where Q > 16), all kv heads per tile or one, scores by
# rows (<= 4 vectors) or through transposes, tail blocks of fewer than 16 keys, blocks that cross
# pages (page size 12); H = 40 takes the per-row path. Contexts are not multiples of 16 or of the
# page size; the rows past the last sequence's and the sequences past num_seqs are padding.
LONG_CHUNK = ([260, 1, 1, 23, 1], [273, 45, 150, 60, 1])  # a causal chunk from 13, beside decodes
SHAPES = {  # num_kv_heads, num_queries_per_kv, head_dim
    "smollm2_like": (3, 3, 64),
    "q1": (8, 1, 64),
    "q8": (2, 8, 64),
    "q8_h128": (2, 8, 128),
    "q32_in_parts": (1, 32, 64),
    "h80": (2, 3, 80),  # 5 lanes of 16: value passes of 4 (or 2) and then 1
    "h40_per_row": (2, 2, 40),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_long_chunk_beside_decodes(shape, dtype):
    K, Q, H = SHAPES[shape]
    kw = dict(num_kv_heads=K, num_queries_per_kv=Q, head_dim=H, dtype=jnp.dtype(dtype))
    check(make_case(*LONG_CHUNK, num_tokens=300, max_num_seqs=7, seed=7, **kw))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["smollm2_like", "q1", "q8_h128", "h80", "h40_per_row"])
def test_decode_batches(shape, dtype):
    K, Q, H = SHAPES[shape]
    kw = dict(num_kv_heads=K, num_queries_per_kv=Q, head_dim=H, dtype=jnp.dtype(dtype))
    kv_lens = [1, 15, 16, 17, 100, 203, 250, 31]
    check(make_case([1] * 8, kv_lens, num_tokens=16, max_num_seqs=11, seed=8, **kw))
    check(make_case([1], [777], seed=9, **kw))  # one tile per kv head (too few to group them)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "sliding_window, soft_cap", [(37, None), (None, 5.0), (20, 3.0)], ids=["window", "cap", "both"]
)
def test_window_and_cap_on_a_long_chunk(sliding_window, soft_cap, dtype):
    case = make_case(
        *LONG_CHUNK,
        page_size=12,
        num_kv_heads=3,
        num_queries_per_kv=3,
        dtype=jnp.dtype(dtype),
        num_tokens=296,
        seed=10,
    )
    check(case, sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize("batch", ["mixed", "long_chunk"])
def test_never_reads_past_kv_len(batch):
    """Keys at or past kv_len (the rest of the last page, unused pages) are NaN: none may reach
    the output."""
    q_lens, kv_lens, page_size = RAGGED_CASES["mixed"] if batch == "mixed" else (*LONG_CHUNK, 12)
    case = make_case(q_lens, kv_lens, page_size=page_size, seed=6)
    read = np.zeros(case.k_pages.shape[:2], bool)  # [num_pages, G]
    for s in range(int(case.num_seqs[0])):
        for j in range(int(case.kv_lens[s])):
            read[case.page_indices[s, j // page_size], j % page_size] = True
    nan = [np.where(read[:, :, None, None], p, np.nan).astype(np.float32) for p in case.args[1:3]]
    check(case, pages=nan)


def test_bad_inputs_name_what_is_wrong():
    case = make_case([1, 1], [5, 9])
    with pytest.raises(ValueError, match="one dtype"):
        kernels_cpu.ragged_paged_attention(case.q.astype(np.float16), *case.args[1:], sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of K=2 kv heads"):
        kernels_cpu.ragged_paged_attention(case.q[:, :3], *case.args[1:], sm_scale=1.0)


def test_engine_on_the_cpu_backend_equals_reference():
    """Greedy tokens on the C++ attention equal the jnp reference's, in a mixed continuous batch
    with chunked prefill and prefix hits (tiny model, float32)."""
    from llmjax import LLM, SamplingParams

    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, 20).tolist()
    prompts = [shared + rng.integers(3, 256, int(n)).tolist() for n in (3, 30, 9, 61, 1)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    opts = dict(load_format="dummy", max_model_len=128, num_pages=64, max_num_batched_tokens=32)
    ref = LLM("tiny", attention_backend="reference", **opts)
    cpu = ref.with_options(attention_backend="cpu")
    assert cpu.engine.runner.attention_backend == "cpu"
    want = [o.token_ids for o in ref.generate(prompts, params)]
    assert [o.token_ids for o in cpu.generate(prompts, params)] == want


def test_bfloat16_model_logits_match_the_reference_backend():
    """bf16 (where greedy tokens of a random model flip on rounding): the model's logits on two
    mixed steps (a chunk beside a whole prompt, then the next chunk beside a decode, shuffled
    pages) match the reference backend's to 2e-2 x max|logit| (the reference rounds the softmax
    weights to bf16 before P.V, the kernel keeps them in float32)."""
    from llmjax.model.attention import make_attention_fn
    from tests.kernels.kernel_testing import mixed_steps_logits

    rng = np.random.default_rng(3)
    a, b = (rng.integers(3, 256, n).tolist() for n in (37, 21))
    run = lambda fn: mixed_steps_logits(fn, a, b)
    ref = run(make_attention_fn("reference"))
    got = run(make_attention_fn("cpu"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


def test_without_the_kernels_auto_is_the_reference():
    code = (
        "import kernels_cpu; from llmjax.model.attention import resolve_attention_backend as r;"
        "print(kernels_cpu.available(), r('auto', 'cpu'))"
    )
    env = dict(os.environ, LLMJAX_CPU_KERNELS="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["False", "reference"], out.stderr
    assert "CPU kernels unavailable" in out.stderr and "LLMJAX_CPU_KERNELS=0" in out.stderr


# A quantized KV cache (issue 41): the pages' bytes (int8, fp8 bits) and a float32 scale per row
# and kv head, against the reference on the dequantized rows. Keys of magnitudes 1e-3 .. 3 and
# values of 1e-3 .. 1e3 (one scale per row: the scales matter), so the outputs reach ~1e3 and
# float32's bound is relative to them (only the summation order differs). An int8 cache's
# int8_scores (VNNI) quantize each query vector first: against the reference given the query
# so quantized (`int8_queries`), the same bound holds.
@pytest.mark.parametrize(
    "kv_cache_dtype, dtype, shape, int8_scores",
    [  # each KV dtype with both q dtypes, each shape (both paths) twice; int8's both scores
        ("int8", "float32", "smollm2_like", False),
        ("int8", "float32", "smollm2_like", True),  # tiles of M <= 4 and of 15 (the chunk)
        ("int8", "bfloat16", "q8_h128", True),
        ("int8", "float32", "h80", True),  # a partial 64-byte slice of the codes
        ("int8", "bfloat16", "h40_per_row", True),  # the portable path: float32 scores
        ("fp8_e4m3", "float32", "q8_h128", False),
        ("fp8_e4m3", "bfloat16", "smollm2_like", False),
        ("fp8_e5m2", "float32", "h40_per_row", False),
        ("fp8_e5m2", "bfloat16", "q8_h128", False),
    ],
)
def test_quantized_cache(kv_cache_dtype, dtype, shape, int8_scores):
    from kernels_cpu import build
    from llmjax.model.kv_cache import dequantize, quantize

    K, Q, H = SHAPES[shape]
    kw = dict(num_kv_heads=K, num_queries_per_kv=Q, head_dim=H, dtype=jnp.dtype(dtype))
    case = make_case(*LONG_CHUNK, num_tokens=300, max_num_seqs=7, seed=11, **kw)
    rng = np.random.default_rng(12)
    rows = case.k_pages.shape[:3]
    k = np.asarray(case.k_pages, np.float32) * 10.0 ** rng.uniform(-3, 0.5, rows)[..., None]
    v = np.asarray(case.v_pages, np.float32) * 10.0 ** rng.uniform(-3, 3, rows)[..., None]
    (kq, ks), (vq, vs) = (quantize(jnp.asarray(x), kv_cache_dtype) for x in (k, v))
    attn = dict(sm_scale=H**-0.5, sliding_window=None, soft_cap=None)
    out = jax.jit(
        lambda q, kq, vq, ks, vs, *rest: kernels_cpu.ragged_paged_attention(
            q, kq, vq, *rest, k_scales=ks, v_scales=vs, kv_cache_dtype=kv_cache_dtype,
            int8_scores=int8_scores, **attn,
        )
    )(case.q, kq, vq, ks, vs, *case.args[3:])  # fmt: skip
    assert out.dtype == case.q.dtype
    deq = [dequantize(x, s, jnp.float32, kv_cache_dtype) for x, s in ((kq, ks), (vq, vs))]
    q32 = np.asarray(jnp.asarray(case.q).astype(jnp.float32))
    ref_attn = dict(attn)
    vnni = build.engines()["ragged_paged_attention"] == "avx512_vnni"
    if int8_scores and vnni and H % 16 == 0:  # the tiles' path (H % 16 == 0) scores in int8
        q32, ref_attn["sm_scale"] = int8_queries(q32, attn["sm_scale"]), 1.0
    ref = np.asarray(ragged_paged_attention_reference(q32, *deq, *case.args[3:], **ref_attn))
    out = np.asarray(out.astype(jnp.float32))
    scale = np.abs(ref).max()
    assert scale > 100  # the large values arrived
    err = np.abs(out - ref).max()
    assert err <= TOL[dtype] * scale, f"max error {err} of {scale}"
    valid = int(case.cu_q_lens[case.num_seqs[0]])
    assert (out[valid:] == 0).all()
    with pytest.raises(ValueError, match="scales"):
        kernels_cpu.ragged_paged_attention(
            case.q, kq, vq, *case.args[3:], kv_cache_dtype=kv_cache_dtype, **attn
        )


def int8_queries(q: np.ndarray, sm_scale: float) -> np.ndarray:
    """q [T, N, H] float32 * sm_scale as the int8-scores path sees it: each vector's int8 codes
    (round to nearest even of x * (127 / max |x|)) times its scale max |x| / 127, in float32."""
    x = q * np.float32(sm_scale)
    top = np.abs(x).max(-1, keepdims=True)
    inv = np.float32(127) / np.where(top > 0, top, np.float32(1))
    return (np.rint(x * inv) * (top / np.float32(127))).astype(np.float32)


def test_int8_scores_compute_the_rounded_query():
    """The int8-scores comparison above can fail: on one case the kernel's output is far from
    the reference without q's rounding (so `int8_queries` is what it computes), and
    int8_scores=False's is far from the rounded one."""
    from kernels_cpu import build
    from llmjax.model.kv_cache import dequantize, quantize

    if build.engines()["ragged_paged_attention"] != "avx512_vnni":
        pytest.skip("int8 scores need AVX-512 VNNI")
    case = make_case([1] * 6, [40, 70, 100, 33, 17, 90], num_kv_heads=3, num_queries_per_kv=3,
                     head_dim=64, max_num_seqs=6, seed=5)  # fmt: skip
    q = np.asarray(case.q, np.float32) * 8.0  # a sharp softmax: q's rounding shows
    (kq, ks), (vq, vs) = (quantize(jnp.asarray(x), "int8") for x in (case.k_pages, case.v_pages))
    deq = [dequantize(x, s, jnp.float32, "int8") for x, s in ((kq, ks), (vq, vs))]
    rest = case.args[3:]
    run = lambda on: np.asarray(kernels_cpu.ragged_paged_attention(
        jnp.asarray(q), kq, vq, *rest, sm_scale=0.125, k_scales=ks, v_scales=vs,
        kv_cache_dtype="int8", int8_scores=on,
    ))  # fmt: skip
    plain = np.asarray(ragged_paged_attention_reference(q, *deq, *rest, sm_scale=0.125))
    rounded = np.asarray(
        ragged_paged_attention_reference(int8_queries(q, 0.125), *deq, *rest, sm_scale=1.0)
    )
    on, off = run(True), run(False)
    err = lambda a, b: np.abs(a - b).max()
    assert err(on, rounded) < 1e-5 < 1e-3 < err(on, plain), (err(on, rounded), err(on, plain))
    assert err(off, plain) < 1e-5 < 1e-3 < err(off, rounded), (err(off, plain), err(off, rounded))
