"""The ragged paged attention specification (kernels_pallas/ragged_paged_attention/reference.py)
against an independent per-sequence numpy loop and against the model's blocked reference
(llmjax/model/attention.py), and the public wrapper's input checks and backend choice."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.ragged_paged_attention import (
    check_inputs,
    default_implementation,
    ragged_paged_attention,
)
from kernels_pallas.ragged_paged_attention.cases import RAGGED_CASES, make_case
from kernels_pallas.ragged_paged_attention.reference import (
    query_positions,
    ragged_paged_attention_reference,
)
from llmjax.model.attention import (
    make_attention_fn,
    paged_attention_reference,
    reference_attention,
    resolve_attention_backend,
)


def numpy_loop(c, *, sm_scale, sliding_window=None, soft_cap=None):
    """Sequence by sequence, query by query, in float64."""
    T, N, H = c.q.shape
    K = c.k_pages.shape[2]
    G = c.k_pages.shape[1]
    out = np.zeros((T, N, H))
    for s in range(int(c.num_seqs[0])):
        lo, hi, kv = int(c.cu_q_lens[s]), int(c.cu_q_lens[s + 1]), int(c.kv_lens[s])
        pages = c.page_indices[s, : -(-kv // G)]
        k = c.k_pages[pages].reshape(-1, K, H)[:kv].astype(np.float64)
        v = c.v_pages[pages].reshape(-1, K, H)[:kv].astype(np.float64)
        for i, t in enumerate(range(lo, hi)):
            pos = kv - (hi - lo) + i
            for n in range(N):
                kh = n // (N // K)
                sc = k[:, kh] @ c.q[t, n].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                j = np.arange(kv)
                ok = j <= pos
                if sliding_window is not None:
                    ok &= pos - j < sliding_window
                sc = np.where(ok, sc, -np.inf)
                p = np.exp(sc - sc.max())
                out[t, n] = (p / p.sum()) @ v[:, kh]
    return out


@pytest.mark.parametrize("name", sorted(RAGGED_CASES))
@pytest.mark.parametrize(
    "opts", [{}, {"sliding_window": 8}, {"soft_cap": 5.0}], ids=["plain", "window", "softcap"]
)
def test_spec_matches_a_numpy_loop(name, opts):
    q_lens, kv_lens, page_size = RAGGED_CASES[name]
    c = make_case(q_lens, kv_lens, page_size=page_size, num_queries_per_kv=2, head_dim=32)
    got = np.asarray(ragged_paged_attention_reference(*c.args, sm_scale=0.3, **opts))
    np.testing.assert_allclose(got, numpy_loop(c, sm_scale=0.3, **opts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(RAGGED_CASES))
def test_spec_matches_the_models_reference_backend(name):
    q_lens, kv_lens, page_size = RAGGED_CASES[name]
    c = make_case(q_lens, kv_lens, page_size=page_size)
    want = np.asarray(ragged_paged_attention_reference(*c.args, sm_scale=0.125))
    n = int(c.cu_q_lens[c.num_seqs[0]])
    # The model's reference takes positions instead of kv_lens (the engine packs both).
    _, positions = query_positions(jnp.asarray(c.cu_q_lens), jnp.asarray(c.kv_lens), len(c.q))
    args = [jnp.asarray(a) for a in (c.q, c.k_pages, c.v_pages, positions, c.cu_q_lens)]
    got = np.asarray(paged_attention_reference(*args, c.page_indices, scale=0.125))
    np.testing.assert_allclose(got[:n], want[:n], rtol=1e-5, atol=1e-5)
    assert not want[n:].any()  # padding rows are 0 in the spec


def test_bad_inputs_are_clear_errors():
    c = make_case([2, 1], [5, 3])
    args = list(c.args)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        check_inputs(c.q[:, :3], *args[1:])
    with pytest.raises(ValueError, match="int32"):
        check_inputs(*args[:3], c.kv_lens.astype(np.int64), *args[4:])
    with pytest.raises(ValueError, match="metadata shapes"):
        check_inputs(*args[:5], c.cu_q_lens[:-1], args[6])
    with pytest.raises(ValueError, match="dtypes differ"):
        check_inputs(c.q.astype(np.float16), *args[1:])
    with pytest.raises(ValueError, match="implementation='cuda'"):
        ragged_paged_attention(*c.args, sm_scale=1.0, implementation="cuda")


def test_a_kernel_named_on_the_wrong_platform_says_so():
    c = make_case([2, 1], [5, 3])
    for impl in ("tpu", "gpu", "mgpu"):
        with pytest.raises(RuntimeError, match=f"the '{impl}' ragged paged attention kernel"):
            ragged_paged_attention(*c.args, sm_scale=1.0, implementation=impl, interpret=False)


def test_backend_choice():
    assert default_implementation("tpu") == "tpu"
    assert default_implementation("cuda") == "gpu" and default_implementation("gpu") == "gpu"
    assert default_implementation("cpu") == "tpu"  # interpreted
    import kernels_cpu

    want_cpu = "cpu" if kernels_cpu.available() else "reference"
    assert resolve_attention_backend("auto", "cpu") == want_cpu  # the C++ kernel where it builds
    with pytest.raises(ValueError, match="runs on the CPU, not on 'gpu'"):
        resolve_attention_backend("cpu", "gpu")
    assert resolve_attention_backend("auto", "tpu") == "pallas"
    assert resolve_attention_backend("auto", "gpu") == "pallas"
    assert resolve_attention_backend("pallas", "cpu") == "pallas"
    assert make_attention_fn("reference") is reference_attention

    # Flash prefill for lone fresh prompts: where measured faster (GPU, >= 2048-token buckets).
    def min_tokens(platform, mode="auto"):
        return make_attention_fn("pallas", platform, flash_prefill=mode).keywords[
            "flash_min_tokens"
        ]

    assert min_tokens("cuda") == 2048 and min_tokens("gpu") == 2048
    assert min_tokens("tpu") is None and min_tokens("cpu") is None  # not measured there
    assert min_tokens("tpu", "on") == 1 and min_tokens("cpu", "on") == 1
    assert min_tokens("cuda", "off") is None
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        resolve_attention_backend("triton", "cpu")
    # A kernel by name (EngineConfig.pallas_kernel); 'auto' leaves the platform's choice.
    fn = make_attention_fn("pallas", "cuda", pallas_kernel="mgpu")
    assert fn.keywords["implementation"] == "mgpu"
    assert fn.keywords["flash_min_tokens"] == 2048  # measured 2.9x its ragged kernel on an H200
    fn = make_attention_fn("pallas", "cuda", flash_prefill="on", pallas_kernel="mgpu")
    assert fn.keywords["flash_min_tokens"] == 1


def test_kernel_options_reach_the_named_kernel_or_say_what_it_takes():
    from llmjax.config import parse_kernel_options

    assert parse_kernel_options(" num_stages=2, warp_specialized=TRUE ,") == {
        "num_stages": 2,
        "warp_specialized": True,
    }
    for bad in ("num_stages", "2=num_stages", "num_stages=two"):
        with pytest.raises(ValueError, match="kernel_options"):
            parse_kernel_options(bad)
    fn = make_attention_fn("pallas", "cuda", pallas_kernel="mgpu", kernel_options="num_stages=2")
    assert fn.keywords["kernel_options"] == (("num_stages", 2),)
    with pytest.raises(
        ValueError, match=r"\['block_kv'\] are not arguments of the 'gpu'.*num_warps"
    ):
        make_attention_fn("pallas", "cuda", pallas_kernel="gpu", kernel_options="block_kv=64")
    with pytest.raises(ValueError, match="name the kernel"):
        make_attention_fn("pallas", "cuda", kernel_options="num_stages=2")
    with pytest.raises(ValueError, match="apply to the pallas and cpu backends"):
        make_attention_fn("reference", "cpu", pallas_kernel="tpu", kernel_options="block_q=8")
    # the CPU kernel's own option (int8_scores), and nothing else
    cpu = make_attention_fn("cpu", "cpu", kernel_options="int8_scores=false")
    assert cpu.keywords["kernel_options"] == (("int8_scores", False),)
    with pytest.raises(ValueError, match=r"\['block_q'\] are not the CPU attention kernel's"):
        make_attention_fn("cpu", "cpu", kernel_options="block_q=8")
    with pytest.raises(ValueError, match="reference takes no kernel options"):
        c = make_case([2, 1], [5, 3])
        ragged_paged_attention(*c.args, sm_scale=1.0, implementation="reference", block_q=8)
    assert make_attention_fn("pallas", "cuda").keywords["implementation"] is None
