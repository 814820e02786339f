"""A quantized KV cache (`CacheConfig.kv_cache_dtype`: int8, fp8_e4m3, fp8_e5m2; issue 41):
the rows' quantization and its error bound on rows of very different magnitudes, the packed form
transfers and tiers move (bitwise), the reference attention over quantized pages against the
same attention over their dequantized values, the model step against the float cache fed the
same quantized values (exactly), and the engine's greedy outputs under chunked prefill, prefix
caching, preemption, tp=2, a P/D transfer and a tier round trip against the same engine without
those features. A page of one KV dtype never serves an engine of another (the page keys' salt,
the transfer's check)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax import LLM, SamplingParams
from llmjax.config import KVStoreConfig
from llmjax.model import kv_cache
from llmjax.model.attention import paged_attention_reference
from llmjax.model.kv_cache import QuantizedPages, allocate_kv_pages, dequantize, quantize
from llmjax.model.llama import forward
from llmjax.model.params import init_params, stack_layers
from tests.helpers import make_step
from tests.parallel_cases import ENGINE_OPTS, prompts

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")
# the largest error of a stored element, relative to its row's absmax: half an int8 step; half
# an fp8 ulp of the largest binade (3 and 2 mantissa bits)
ROW_ERROR = {"int8": 0.5 / 127, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _rows(rng, shape):
    """Random rows [..., H] whose magnitudes span 1e-4 .. 1e4 (one scale per row), a few zero."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= 10.0 ** rng.uniform(-4, 4, shape[:-1])[..., None]
    x[(0,) * (len(shape) - 1)] = 0.0
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_rows_are_stored_within_the_dtype_error_of_their_own_scale(name):
    x = _rows(np.random.default_rng(0), (64, 3, 32))
    values, scales = quantize(jnp.asarray(x), name)
    assert values.dtype == kv_cache.storage_dtype(name) and scales.shape == (64, 3, 1)
    back = np.asarray(dequantize(values, scales, jnp.float32, name))
    absmax = np.abs(x).max(-1, keepdims=True)
    assert np.all(np.abs(back - x) <= ROW_ERROR[name] * absmax * (1 + 1e-6))
    assert np.all(back[0, 0] == 0) and float(scales[0, 0, 0]) == 0.0  # a zero row stays zero
    # each row uses the whole range: its largest element is stored as the dtype's largest value
    elements = dequantize(values, jnp.ones_like(scales), jnp.float32, name)
    top = np.abs(np.asarray(elements)).max(-1)[1:]
    np.testing.assert_allclose(top, kv_cache.QUANTIZED_KV[name][1], rtol=1e-6)
    # tiny rows keep their precision (a per-tensor scale would flush them to zero)
    small = absmax[..., 0] < 1e-3
    assert small.sum() > 10 and np.all(np.abs(back - x)[small] <= ROW_ERROR[name] * 1e-3)


@pytest.mark.parametrize("name", QUANTIZED)
def test_pack_and_unpack_are_bitwise(name):
    x = _rows(np.random.default_rng(1), (5, 4, 2, 16))
    pages = QuantizedPages(*quantize(jnp.asarray(x), name), name)
    packed = kv_cache.pack_pages(pages)
    assert packed.dtype == jnp.uint8 and packed.shape == (5, 4, 2, 16 + 4)
    assert kv_cache.packed_row(16, jnp.float32, name) == (20, np.dtype(np.uint8))
    back = kv_cache.unpack_pages(packed, name)
    np.testing.assert_array_equal(
        np.asarray(back.values).view(np.uint8), np.asarray(pages.values).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(pages.scales))


def _random_step(rng, page_size, num_pages):
    """A ragged step: a prefill chunk after cached tokens, a fresh prompt, two decodes."""
    free = list(rng.permutation(np.arange(1, num_pages)))
    seqs = []
    for new, start in ((7, 9), (12, 0), (1, 20), (1, 5)):
        n = -(-(start + new) // page_size)
        table, free = [int(p) for p in free[:n]], free[n:]
        seqs.append((list(rng.integers(1, 100, new)), start, table))
    return make_step(seqs, page_size, num_tokens=24, max_pages=8)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("window", [None, 6])
def test_reference_attention_reads_the_stored_values(name, window):
    """Over QuantizedPages the reference attention equals (bitwise) the same attention over float
    pages holding the dequantized values, and differs from attending the unquantized rows by
    no more than the quantization can explain."""
    rng = np.random.default_rng(2)
    G, P, K, N, H = 4, 24, 2, 4, 16
    step = _random_step(rng, G, P)
    k, v = _rows(rng, (P, G, K, H)), _rows(rng, (P, G, K, H))
    q = jnp.asarray(rng.standard_normal((24, N, H)), jnp.float32)
    kq, vq = (QuantizedPages(*quantize(jnp.asarray(a), name), name) for a in (k, v))
    kw = dict(scale=0.25, sliding_window=window)
    args = (step.positions, step.cu_q_lens, step.page_indices)
    got = paged_attention_reference(q, kq, vq, *args, **kw)
    want = paged_attention_reference(
        q, kq.dequantize(jnp.float32), vq.dequantize(jnp.float32), *args, **kw
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    exact = paged_attention_reference(q, jnp.asarray(k), jnp.asarray(v), *args, **kw)
    assert not np.array_equal(np.asarray(got), np.asarray(exact))


def _stored_as(name):
    """Patches for llama's write_kv / as_stored: a float cache fed the quantized values."""

    def write(k_pages, v_pages, k, v, slots):
        fq = functools.partial(kv_cache.fake_quantize, kv_cache_dtype=name)
        return kv_cache.write_kv(k_pages, v_pages, fq(k), fq(v), slots)

    return write, lambda x, pages: kv_cache.fake_quantize(x, name)


@pytest.mark.parametrize(
    "name, layer_loop", [("int8", "scan"), ("fp8_e4m3", "unroll"), ("fp8_e5m2", "scan")]
)
def test_step_equals_a_float_cache_holding_the_quantized_values(name, layer_loop, monkeypatch):
    """Two steps (a prompt chunk, then a chunk and a decode) over a quantized cache give the
    logits, exactly, of the same steps over a float32 cache into which the model writes (and
    from which the step's own tokens attend) the quantized-then-dequantized K and V."""
    from llmjax.model import llama

    config = configs.get_preset("tiny")
    params = init_params(config, jax.random.key(0), jnp.float32)
    if layer_loop == "scan":
        params = stack_layers(params)
    stacked = layer_loop == "scan"
    G, num_pages = 4, 24
    rng = np.random.default_rng(3)
    a, b = rng.integers(1, 200, 13).tolist(), rng.integers(1, 200, 6).tolist()
    steps = [
        make_step([(a[:9], 0, [3, 7, 1])], G, num_tokens=16, max_pages=4),
        make_step([(a[9:], 9, [3, 7, 1, 9]), (b, 0, [2, 5])], G, num_tokens=16, max_pages=4),
    ]

    def run(kv_cache_dtype):
        kv = allocate_kv_pages(config, num_pages, G, jnp.float32, stacked, kv_cache_dtype)
        out = []
        for step in steps:  # eagerly: the patches below must not meet a cached trace
            with jax.disable_jit():
                logits, kv = forward(params, kv, step, config)
            out.append(np.asarray(logits))
        return out

    got = run(name)
    plain = run("auto")
    with monkeypatch.context() as m:
        write, stored = _stored_as(name)
        m.setattr(llama, "write_kv", write)
        m.setattr(llama, "as_stored", stored)
        want = run("auto")
    for g, w, p in zip(got, want, plain, strict=True):
        np.testing.assert_array_equal(g, w)
        assert not np.array_equal(g, p)  # the quantization is there


@functools.cache
def _llm(kv_cache_dtype: str, tp: int = 1, pp: int = 1) -> LLM:
    return LLM("tiny", tp=tp, pp=pp, kv_cache_dtype=kv_cache_dtype, **ENGINE_OPTS)


def _tokens(outs):
    return [o.token_ids for o in outs]


@functools.cache
def _alone(kv_cache_dtype: str) -> list[list[int]]:
    """Each prompt alone, whole (no chunking), no prefix cache: the reference outputs."""
    llm = _llm(kv_cache_dtype).with_options(prefix_cache="none", max_num_batched_tokens=128)
    return [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts(8)]


@pytest.mark.parametrize("name", ["int8"])  # fp8: the step test above; its kernels are the same
def test_chunking_prefix_hits_and_preemption_leave_outputs_unchanged(name):
    """Eight requests at once, their prompts chunked beside decodes, half of them sharing a
    cached prefix, in a cache small enough to preempt: each output is the one it has alone."""
    llm = _llm(name).with_options(num_pages=30)
    got = _tokens(llm.generate(prompts(8), GREEDY, use_tqdm=False))
    assert got == _alone(name)
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.num_cached_prefill_tokens > 0
    pages = llm.engine.runner.kv_pages[0]  # stacked (k, v); the step test shows they are read
    assert isinstance(pages, QuantizedPages) and pages.kv_cache_dtype == name
    import kernels_cpu  # 'auto' reads a quantized cache with the C++ kernel where it builds

    assert llm.engine.runner.attention_backend == (
        "cpu" if kernels_cpu.available() else "reference"
    )


def test_pp2_equals_one_device():
    """(tp = 2: the P/D test below, both sides on two devices.)"""
    llm = _llm("int8", pp=2)
    got = _tokens(llm.generate(prompts(8), GREEDY, use_tqdm=False))
    assert got == _alone("int8")
    pages = llm.engine.runner.kv_pages[0]  # stacked: (k, v)
    assert isinstance(pages, QuantizedPages)
    assert pages.scales.sharding.spec[0] == "pp"  # each stage holds its layers' pages, scales


def test_pd_transfer_moves_quantized_pages_bitwise_and_refuses_another_dtype():
    from llmjax.cluster import Cluster, InstanceSpec, LocalInstance
    from llmjax.cluster.launch import split_devices
    from llmjax.cluster.transfer import LocalTransport, TransferError

    def instances(dtypes, transport):
        specs = [InstanceSpec("prefill", tp=2), InstanceSpec("decode", tp=2)]
        devs = split_devices(jax.devices(), specs)
        return [
            LocalInstance(
                _llm(d, tp=2).with_options(role=s.role, devices=dv).engine, transport, s.role
            )
            for d, s, dv in zip(dtypes, specs, devs, strict=True)
        ]

    transport = LocalTransport()
    pre, dec = instances(["int8", "int8"], transport)
    got = _tokens(Cluster([pre, dec], "round_robin").generate(prompts(8), GREEDY))
    assert got == _alone("int8")  # tp = 2 on both sides: one device's outputs
    assert pre.engine.runner.kv_pages[0].scales.sharding.spec[2] is not None  # split by kv head
    # one transfer by hand: the bytes that arrive are the bytes that left
    pre.engine.add_request(prompts(8)[3], GREEDY, request_id="r")
    while not pre.engine.parked:
        pre.step()
    m, src_pages = pre.engine.export_request("r")
    src = np.asarray(pre.engine.runner.export_pages(src_pages))
    assert src.dtype == np.uint8 and src.shape[-1] == configs.get_preset("tiny").head_dim + 4
    m, offer = pre.offer("r")
    assert offer.kv_cache_dtype == "int8"
    dec.begin_import(m, offer, timeout_s=30.0, on_failure="recompute")
    dst_pages = dec._imports["r"].pages
    [res] = dec.poll_imports()
    assert res.status == "done"
    n = len(src_pages)
    dst = np.asarray(dec.engine.runner.export_pages(dst_pages))
    np.testing.assert_array_equal(dst[:, :, :n], src[:, :, :n])
    assert np.abs(src[:, :, :n].astype(np.int32)).sum() > 0
    dec.engine.abort_request("r")
    pre.release("r")
    # an fp8 decode instance must not read int8 bytes
    _, fp8 = instances(["int8", "fp8_e4m3"], transport)
    pre.engine.add_request(prompts(8)[5], GREEDY, request_id="s")
    while not pre.engine.parked:
        pre.step()
    m, offer = pre.offer("s")
    with pytest.raises(TransferError, match="kv_cache_dtype must match"):
        transport.poll(transport.pull(offer, fp8.engine.runner, deadline=1e18))
    pre.release("s")


def test_tier_round_trip_and_salts(tmp_path):
    """Blocks stored in host memory and on disk come back into a quantized cache with the
    outputs of computing them; the salt (the page keys, the tier's store) differs per dtype."""
    from llmjax.kvstore import KeySalt

    kv = KVStoreConfig(
        host_blocks=64, disk_dir=str(tmp_path), block_size=8, write_policy="write_through",
        load_policy="always",
    )  # fmt: skip
    llm = _llm("int8").with_options(kv_store=kv, prefix_cache="radix")
    outs = []
    for p in prompts(8):
        outs += llm.generate([p], GREEDY, use_tqdm=False)
        llm.engine.reset_prefix_cache()  # a later hit is a load from a lower tier
    assert _tokens(outs) == _alone("int8")
    assert llm.engine.kv_tiers.stats.num_loads > 0
    salts = {d: KeySalt.for_engine(_llm(d).engine.config).digest for d in ("auto", *QUANTIZED)}
    assert len(set(salts.values())) == 4
    assert llm.engine.block_manager.prefix_cache.salt == salts["int8"]


def test_bytes_per_page_and_the_simulators_pages():
    from llmjax.config import CacheConfig, EngineConfig
    from llmjax.sim.roofline import kv_page_bytes_per_device
    from llmjax.sim.runner import SimConfig, sim_num_pages

    tiny = configs.get_preset("tiny")
    f32 = kv_cache.kv_cache_bytes(tiny, 10, 16, jnp.float32)
    i8 = kv_cache.kv_cache_bytes(tiny, 10, 16, jnp.float32, "int8")
    assert f32 == 2 * tiny.num_layers * 10 * 16 * tiny.num_kv_heads * tiny.head_dim * 4
    assert i8 == 2 * tiny.num_layers * 10 * 16 * tiny.num_kv_heads * (tiny.head_dim + 4)
    pages = allocate_kv_pages(tiny, 10, 16, jnp.float32, True, "int8")
    assert sum(x.nbytes for x in jax.tree.leaves(pages)) == i8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="'mgpu' does not read a fp8_e4m3 KV cache"):
        EngineConfig(
            model=configs.get_preset("smollm2-135m-instruct"), dtype="bfloat16",
            pallas_kernel="mgpu", cache=CacheConfig(kv_cache_dtype="fp8_e4m3"),
        )  # fmt: skip
    model = configs.get_preset("llama2-7b")
    bf16 = kv_page_bytes_per_device(model, 16, "bfloat16", 1, 1)
    fp8 = kv_page_bytes_per_device(model, 16, "bfloat16", 1, 1, "fp8_e4m3")
    assert bf16 / fp8 == pytest.approx(2 * 128 / (128 + 4))
    sims = {
        d: sim_num_pages(
            EngineConfig(
                model=model, dtype="bfloat16", device="sim", sim=SimConfig(hardware="a100-80gb"),
                cache=CacheConfig(kv_cache_dtype=d),
            )
        )
        for d in ("auto", "fp8_e4m3")
    }  # fmt: skip
    assert sims["fp8_e4m3"] / sims["auto"] == pytest.approx(bf16 / fp8, rel=1e-3)


@pytest.mark.parametrize("name", ["int8"])  # fp8: tests/kernels/test_rpa_quantized.py
def test_pallas_kernels_read_the_quantized_cache(name, monkeypatch):
    """attention_backend='pallas' (the TPU kernels, interpreted here) over a quantized cache: a
    lone fresh prompt takes flash prefill over the step's K/V as the pages store them (counted),
    a batch the ragged kernel over codes and scales; the greedy outputs are the reference
    backend's."""
    import kernels_pallas.flash_prefill as flash_module

    ran, real = [], flash_module.flash_prefill_attention

    def counting_flash(q, k, v, seq_len, **kw):
        jax.debug.callback(lambda n: ran.append(int(n[0])), seq_len)
        return real(q, k, v, seq_len, **kw)

    monkeypatch.setattr(flash_module, "flash_prefill_attention", counting_flash)
    base = _llm(name).with_options(
        scheduler_policy="prefill_first", prefix_cache="none", max_num_batched_tokens=128
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)  # interpreted kernels: keep it short
    batch = prompts(8)[:2]
    want = [_tokens(base.generate(b, params)) for b in (batch[:1], batch)]
    llm = base.with_options(attention_backend="pallas", flash_prefill="on")
    assert llm.engine.runner.attention_backend == "pallas"
    assert [_tokens(llm.generate(b, params)) for b in (batch[:1], batch)] == want
    assert ran and set(ran) == {len(batch[0])}  # the lone prompt only (once per layer)
    assert isinstance(llm.engine.runner.kv_pages[0], QuantizedPages)


@functools.cache
def _sparse_base(kv_cache_dtype: str) -> LLM:
    return LLM(
        "tiny", load_format="dummy", page_size=4, max_num_batched_tokens=32, max_num_seqs=8,
        max_model_len=128, compilation_cache_dir="", calibration_tokens=64,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["infinigen", "quest", "h2o"])
def test_sparse_kv_over_a_quantized_pool(mode):
    """Sparse KV over a quantized pool (codes and scales in host memory, dequantized on the
    device after each fetch): selecting everything gives the dense engine's greedy outputs over
    the same quantized cache, and a selection that keeps little still serves."""
    from llmjax.config import SparseKVConfig

    batch = [p[:16] for p in prompts(8)[:2]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    base = _sparse_base("int8")
    want = _tokens(base.with_options(prefix_cache="none").generate(batch, params))
    everything = dict(alpha=1e9, max_num_kv=None, num_dense_layers=1)
    if mode == "h2o":
        everything = dict(max_num_kv=None, num_dense_layers=1)
    llm = base.with_options(sparse_kv=SparseKVConfig(mode=mode, **everything), prefix_cache="none")
    pool = llm.engine.runner.kv_pages[0][0]
    assert isinstance(pool, QuantizedPages) and pool.values.dtype == jnp.int8
    assert _tokens(llm.generate(batch, params)) == want
    assert llm.engine.stats.num_sparse_steps > 0


def test_sparse_kv_fetches_the_quantized_bytes():
    """Sparse KV's offload mode fetches every cached row each step: over an int8 pool the bytes
    are (H + 4) / (4 H) of a float32 pool's, for the same rows and the same greedy outputs."""
    from llmjax.config import SparseKVConfig

    batch = [p[:16] for p in prompts(8)[:2]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {}
    for d in ("auto", "int8"):
        llm = _sparse_base(d).with_options(sparse_kv=SparseKVConfig(mode="offload"))
        runs[d] = (_tokens(llm.generate(batch, params)), llm.engine.stats.h2d_bytes)
    H = configs.get_preset("tiny").head_dim
    assert runs["int8"][1] * 4 * H == runs["auto"][1] * (H + 4)
    assert runs["int8"][1] > 0
