"""Attention over the paged KV cache: the backend interface, its plain-jnp reference, and the
choice of backend by name (`EngineConfig.attention_backend`).

Interface (`AttentionFn`): `attention_fn(q [T, N, H], k_pages, v_pages [num_pages, G, K, H],
step: StepInput, *, sm_scale, sliding_window, soft_cap, new_kv) -> [T, N, H]`, the contract of
kernels_pallas/ragged_paged_attention/reference.py (scores q.k * sm_scale, soft capped to
soft_cap * tanh(s / soft_cap) where soft_cap is set, then masked); `new_kv` = the step's own
(k, v) [T, K, H] (already written to the pages, as the pages store them; a backend may use them
for a fresh prompt). With a quantized cache (`CacheConfig.kv_cache_dtype`) the pages are
`QuantizedPages` (values and a scale per token and kv head, llmjax/model/kv_cache.py), which the
reference dequantizes as it gathers, the CPU kernel reads in place and the Pallas kernels ('tpu',
'gpu'; not 'mgpu') dequantize after each page copy.
Backends:
  reference  `reference_attention` below (plain jnp; fast enough on a CPU).
  pallas     `pallas_attention`: kernels_pallas' ragged paged attention (the TPU or GPU kernel of
             the platform, or one by name: `EngineConfig.pallas_kernel`; in interpret mode on the
             CPU, slow, for checking), and for a step that is one fresh prompt in a big enough
             bucket, kernels_pallas' flash prefill over `new_kv` (`EngineConfig.flash_prefill`),
             chosen at run time by `lax.cond`.
  cpu        `cpu_attention`: kernels_cpu/'s C++ ragged paged attention (XLA FFI), which reads
             each key and value row straight from the pages (2-4x the reference on decodes,
             2x on a prefill chunk, more on mixed batches); CPU only.
  auto       pallas on GPU/TPU; on the CPU, cpu where its kernels build (a C++ compiler), else
             reference.

Letters: T tokens, S sequences, P pages per sequence, G page size, K kv heads, Q query heads per kv
head, N = K * Q query heads, H head dim, C key positions (= P * G).

The reference gathers, for every query token, its own sequence's pages and masks by position:
key j is visible to a token at position p iff j <= p (and p - j < sliding_window). One model may
call it with different windows in different layers (llmjax/model/llama.py `attend`). Its cost is
O(T * C) like the attention itself, with no waste across sequences of a mixed batch. The Pallas
kernels (kernels_pallas/) implement the same contract.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from llmjax.config import ATTENTION_BACKENDS
from llmjax.model.kv_cache import Pages, QuantizedPages, take_pages
from llmjax.model.step_input import StepInput

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., jax.Array]

# Query tokens per block in the reference; bounds the gathered KV at [block, C, K, H].
REFERENCE_Q_BLOCK = 32


def token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """[S + 1] cumulative lengths -> [T] sequence index of every token (padding maps past the end,
    clamped to the last sequence row, whose outputs are dropped)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2)


def paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    k_pages: Pages,  # [num_pages, G, K, H]; QuantizedPages: dequantized as gathered
    v_pages: Pages,  # [num_pages, G, K, H]
    positions: jax.Array,  # [T] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    page_indices: jax.Array,  # [S, P] int32
    *,
    scale: float,
    sliding_window: int | None = None,
    mask_holes: bool = False,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of every query token over its sequence's cached keys -> [T, N, H].

    `mask_holes`: keys in pages whose table entry is the reserved page 0 are invisible (pages a
    sparse-KV pool evicted, llmjax/sparse/host_pool.py); off, page 0 is never read in range.

    Query tokens go in blocks of REFERENCE_Q_BLOCK. A block whose tokens all belong to one
    sequence (the body of a prefill chunk) gathers that sequence's pages once; a mixed block
    (decodes, chunk boundaries) gathers each token's pages. Both give the same numbers; the first
    moves 1/REFERENCE_Q_BLOCK of the bytes.
    """
    T, N, H = q.shape
    K = k_pages.shape[2]
    page_indices = jnp.asarray(page_indices)  # indexed by traced ids inside lax.map/cond
    seq_ids = token_seq_ids(jnp.asarray(cu_q_lens), T)  # [T]

    G = k_pages.shape[1]

    def attend(qg, k, v, pos_blk, kv_spec, pages):
        """qg: [B, K, Q, H]; k, v: [C, K, H] shared by the block ("ckh") or [B, C, K, H] one per
        token ("bckh"); pages: [P] or [B, P] their page ids -> [B, N, H]."""
        B = qg.shape[0]
        s = jnp.einsum(f"bkqh,{kv_spec}->bkqc", qg, k, preferred_element_type=jnp.float32)
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = jnp.arange(s.shape[-1], dtype=jnp.int32)[None, :]  # [1, C]
        visible = key_pos <= pos_blk[:, None]  # [B, C]
        if mask_holes:
            visible &= jnp.repeat(pages != 0, G, axis=-1).reshape(-1, s.shape[-1])
        if sliding_window is not None:
            visible &= key_pos > pos_blk[:, None] - sliding_window
        # With holes a padded token may see no key at all: a finite floor keeps it from NaN.
        floor = -1e30 if mask_holes else -jnp.inf
        s = jnp.where(visible[:, None, None, :], s, floor)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum(f"bkqc,{kv_spec}->bkqh", p, v, preferred_element_type=jnp.float32)
        return o.reshape(B, N, H).astype(q.dtype)

    def per_token(q_blk, pos_blk, seq_blk):
        B = q_blk.shape[0]
        pages = page_indices[seq_blk]  # [B, P]
        k = take_pages(k_pages, pages, q.dtype).reshape(B, -1, K, H)  # [B, C, K, H]
        v = take_pages(v_pages, pages, q.dtype).reshape(B, -1, K, H)
        return attend(q_blk.reshape(B, K, N // K, H), k, v, pos_blk, "bckh", pages)

    def one_sequence(q_blk, pos_blk, seq_blk):
        B = q_blk.shape[0]
        pages = page_indices[seq_blk[0]]  # [P]
        k = take_pages(k_pages, pages, q.dtype).reshape(-1, K, H)  # [C, K, H]
        v = take_pages(v_pages, pages, q.dtype).reshape(-1, K, H)
        return attend(q_blk.reshape(B, K, N // K, H), k, v, pos_blk, "ckh", pages)

    def block(q_blk, pos_blk, seq_blk):
        # Sequence ids never decrease along the flat batch, so first == last means one sequence.
        is_one_sequence = seq_blk[0] == seq_blk[-1]
        return jax.lax.cond(is_one_sequence, one_sequence, per_token, q_blk, pos_blk, seq_blk)

    B = min(T, REFERENCE_Q_BLOCK)
    if T % B:
        return per_token(q, positions, seq_ids)
    blocks = (q.reshape(-1, B, N, H), positions.reshape(-1, B), seq_ids.reshape(-1, B))
    return jax.lax.map(lambda b: block(*b), blocks).reshape(T, N, H)


def reference_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,
    step: StepInput,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """The 'reference' backend: `paged_attention_reference` on the step's metadata (`new_kv` is
    not needed: the pages hold it)."""
    del new_kv
    return paged_attention_reference(
        q,
        k_pages,
        v_pages,
        step.positions,
        step.cu_q_lens,
        step.page_indices,
        scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )


def _codes_and_scales(k_pages: Pages, v_pages: Pages) -> tuple[jax.Array, jax.Array, dict]:
    """(k, v, kwargs) for a kernel: plain pages as they are; `QuantizedPages` as their codes,
    with `k_scales`, `v_scales` and `kv_cache_dtype` in kwargs (read in place by the kernel)."""
    if not isinstance(k_pages, QuantizedPages):
        return k_pages, v_pages, {}
    quantized = dict(
        k_scales=k_pages.scales, v_scales=v_pages.scales, kv_cache_dtype=k_pages.kv_cache_dtype
    )
    return k_pages.values, v_pages.values, quantized


def cpu_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,
    step: StepInput,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    kernel_options: tuple[tuple[str, int | bool], ...] = (),
) -> jax.Array:
    """The 'cpu' backend: kernels_cpu.ragged_paged_attention on the step's metadata;
    `kernel_options` (name, value) pairs are its keyword arguments (EngineConfig.kernel_options:
    int8_scores)."""
    from kernels_cpu import ragged_paged_attention

    del new_kv
    k_pages, v_pages, quantized = _codes_and_scales(k_pages, v_pages)
    return ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        step.kv_lens,
        step.page_indices,
        step.cu_q_lens,
        step.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        **quantized,
        **dict(kernel_options),
    )


def pallas_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,
    step: StepInput,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    flash_min_tokens: int | None = None,
    implementation: str | None = None,
    kernel_options: tuple[tuple[str, int | bool], ...] = (),
) -> jax.Array:
    """The 'pallas' backend: the ragged paged attention kernel `implementation` (None: the
    platform's; kernels_pallas/platforms.py), in interpret mode on the CPU. In token buckets of at
    least `flash_min_tokens` (None: never), a step that is one fresh prompt (one sequence, kv_len ==
    its query count: nothing cached) attends with the flash prefill kernel over `new_kv` instead;
    `lax.cond` picks at run time, so each bucket still compiles once. `kernel_options` (name,
    value) pairs go to the ragged kernel's function (EngineConfig.kernel_options)."""
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention

    k_codes, v_codes, quantized = _codes_and_scales(k_pages, v_pages)  # dequantized per copy

    def ragged():
        return ragged_paged_attention(
            q,
            k_codes,
            v_codes,
            step.kv_lens,
            step.page_indices,
            step.cu_q_lens,
            step.num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            implementation=implementation,
            **quantized,
            **dict(kernel_options),
        )

    if new_kv is None or flash_min_tokens is None or q.shape[0] < flash_min_tokens:
        return ragged()
    from kernels_pallas.flash_prefill import flash_prefill_attention

    n = step.cu_q_lens[1]  # the first sequence's query count
    fresh_prompt = (step.num_seqs[0] == 1) & (step.kv_lens[0] == n)

    def flash():
        k, v = new_kv  # as the pages store them (a quantized cache: dequantized)
        return flash_prefill_attention(
            q,
            k,
            v,
            n[None],
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            implementation=implementation,
        )

    return jax.lax.cond(fresh_prompt, flash, ragged)


def flash_min_tokens(
    mode: str, platform: str | None = None, implementation: str | None = None
) -> int | None:
    """EngineConfig.flash_prefill -> the smallest token bucket that may use flash prefill
    (None: none). 'auto': the measured threshold of the kernel pair (`implementation`, default
    the platform's; flash_prefill/tuning.py ENGINE_MIN_TOKENS), 'on': every bucket, 'off': none."""
    if mode == "off":
        return None
    if mode == "on":
        return 1
    from kernels_pallas.flash_prefill.tuning import ENGINE_MIN_TOKENS
    from kernels_pallas.platforms import default_implementation

    return ENGINE_MIN_TOKENS[implementation or default_implementation(platform)]


def resolve_attention_backend(name: str, platform: str | None = None) -> str:
    """'auto' -> 'pallas' on GPU/TPU; on the CPU 'cpu' where kernels_cpu builds, else
    'reference'. Other names are checked ('cpu' runs on the CPU only, and needs its kernels).
    Every backend reads a quantized cache (of the Pallas kernels, 'mgpu' refuses it)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")
    platform = platform or jax.default_backend()
    if name == "auto":
        if platform != "cpu":
            return "pallas"
        import kernels_cpu

        return "cpu" if kernels_cpu.available() else "reference"
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on {platform!r}")
        import kernels_cpu

        kernels_cpu.load()  # raises KernelsUnavailable with the reason
    if name == "pallas" and platform == "cpu":
        logger.warning(
            "attention_backend='pallas' on the CPU runs the kernel in interpret mode (slow)"
        )
    return name


def shard_heads(attention_fn: AttentionFn, mesh) -> AttentionFn:
    """`attention_fn` run per device on its own heads (tensor parallelism): q [T, N, H] and the
    new k/v split over heads, KV pages [num_pages, G, K, H] over kv heads, the step metadata
    replicated; the kernels see a plain single-device problem with N/tp and K/tp heads (query
    heads of a kv head stay on its device: llmjax/parallel/heads.py)."""
    from jax.sharding import PartitionSpec as P

    from llmjax.parallel.mesh import TP_AXES

    heads = P(None, TP_AXES, None)
    pages = P(None, None, TP_AXES, None)  # QuantizedPages: its values and scales [.., 1] alike

    def sharded(
        q, k_pages, v_pages, step, *, sm_scale, sliding_window=None, soft_cap=None, new_kv=None
    ):
        kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if new_kv is None:
            f = functools.partial(attention_fn, **kw)
            specs, args = (heads, pages, pages, P()), (q, k_pages, v_pages, step)
        else:

            def f(q, k_pages, v_pages, step, k, v):
                return attention_fn(q, k_pages, v_pages, step, new_kv=(k, v), **kw)

            specs, args = (heads, pages, pages, P(), heads, heads), (q, k_pages, v_pages, step)
            args += tuple(new_kv)
        # Inside the pipeline's shard_map (manual over 'pp') the mesh in context is that mesh
        # with 'pp' manual: nest in it. check_vma=False: Pallas kernels carry no varying-axis
        # types.
        context = jax.sharding.get_abstract_mesh()
        m = context if not context.empty and context.manual_axes else mesh
        return jax.shard_map(f, mesh=m, in_specs=specs, out_specs=heads, check_vma=False)(*args)

    return sharded


def make_attention_fn(
    name: str,
    platform: str | None = None,
    *,
    flash_prefill: str = "auto",
    pallas_kernel: str = "auto",
    kernel_options: str = "",
    mesh=None,
) -> AttentionFn:
    """The attention function of backend `name` ('auto', 'reference', 'pallas' or 'cpu');
    `flash_prefill` ('auto', 'on', 'off'), `pallas_kernel` ('auto' or a kernel's name) and
    `kernel_options` (that kernel's arguments, 'key=value,...'; see EngineConfig) for the pallas
    backend (see `pallas_attention`); with a `mesh` of more than one tensor-parallel device, run
    per device on its heads (`shard_heads`)."""
    from llmjax.parallel.mesh import TP_AXES, mesh_axes_size

    fn = _attention_fn(name, platform, flash_prefill, pallas_kernel, kernel_options)
    if mesh is not None and mesh_axes_size(mesh, TP_AXES) > 1:
        return shard_heads(fn, mesh)
    return fn


def _attention_fn(
    name: str, platform: str | None, flash_prefill: str, pallas_kernel: str, kernel_options: str
) -> AttentionFn:
    from llmjax.config import parse_kernel_options

    backend = resolve_attention_backend(name, platform)
    options = parse_kernel_options(kernel_options)
    if backend == "cpu":
        from kernels_cpu.ragged_paged_attention import check_kernel_options

        check_kernel_options(options)
        if not options:
            return cpu_attention
        return functools.partial(cpu_attention, kernel_options=tuple(sorted(options.items())))
    if backend == "reference":
        if options:
            raise ValueError(
                f"kernel_options={kernel_options!r} apply to the pallas and cpu backends; the "
                f"attention backend here is 'reference' (attention_backend={name!r})"
            )
        return reference_attention
    # On the CPU the kernels are the TPU ones, interpreted: 'auto' leaves flash prefill off there.
    implementation = None if pallas_kernel == "auto" else pallas_kernel
    if options:
        from kernels_pallas.ragged_paged_attention import check_kernel_options

        if implementation is None:
            raise ValueError(
                f"kernel_options={kernel_options!r} are one kernel's arguments: name the kernel "
                "with pallas_kernel ('tpu', 'gpu' or 'mgpu')"
            )
        check_kernel_options(implementation, options)
    min_tokens = flash_min_tokens(flash_prefill, platform, implementation)
    return functools.partial(
        pallas_attention,
        flash_min_tokens=min_tokens,
        implementation=implementation,
        kernel_options=tuple(sorted(options.items())),
    )
