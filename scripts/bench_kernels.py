"""Kernel benchmark: ragged paged attention implementations on decode-heavy, prefill-heavy and
mixed batches, with achieved memory bandwidth and FLOP/s next to the device's roofline.

    python scripts/bench_kernels.py                                  # this device's defaults
    python scripts/bench_kernels.py --implementations reference,model_reference,tpu --interpret
    python scripts/bench_kernels.py --num_decodes 64 --decode_kv_len 4096 --dtype bfloat16

Implementations (--implementations):
  reference        the jnp specification (kernels_pallas/ragged_paged_attention/reference.py)
  model_reference  the engine's blocked jnp reference (llmjax/model/attention.py)
  cpu              kernels_cpu/'s C++ kernel (XLA FFI; the CPU only, where it builds)
  tpu, gpu, mgpu   our Pallas kernels: Mosaic TPU, Triton GPU, Mosaic GPU (Hopper; bf16/f16 only)
                   (compiled on their platform; elsewhere only with --interpret)
  jax_tpu          jax.experimental.pallas.ops.tpu.ragged_paged_attention (TPU; K/V interleaved)
  jax_gpu          jax.experimental.pallas.ops.gpu.paged_attention (CUDA; decode batches only)
  jax_gpu_mha      jax.experimental.pallas.ops.gpu.attention.mha, causal (CUDA; the prefill batch
                   only; K/V repeated to every query head, as it has no GQA)
  jax_gpu_fa3      jax.experimental.pallas.ops.gpu.attention_mgpu.attention, causal, GQA: JAX's
                   FlashAttention-3 on Mosaic GPU (Hopper; run in float16, the only dtype
                   it lowers for in JAX 0.11.2; the prefill batch only)
  cudnn            jax.nn.dot_product_attention(implementation="cudnn"), causal, GQA (CUDA; the
                   prefill batch only): the vendor's flash attention, the bar for prefill
  flash_tpu, flash_gpu, flash_mgpu  kernels_pallas/flash_prefill: Mosaic TPU, Triton GPU,
                   warp-specialized Mosaic GPU (Hopper; bf16/f16) (one prompt with no cache hit:
                   the prefill batch only; its K/V given dense, as the new tokens' projections are)
Kernel block sizes are swept with --variant (repeatable), e.g.
    --variant gpu:block_q=1,pages_per_block=8,num_kv_splits=4,num_warps=4
    --variant mgpu:pages_per_block=8,num_stages=2
    --variant flash_gpu:block_q=64,block_kv=64,num_warps=8,num_stages=3
    --variant flash_mgpu:block_kv=64,num_stages=2,pingpong=0
    --variant jax_gpu_fa3:block_q=64,block_kv=128,max_concurrent_steps=2
each timed as its own row; the keyword arguments go to the kernel function (kernel_gpu.py,
kernel_tpu.py, kernel_mgpu.py; jax_gpu: paged_attention, jax_gpu_fa3: attention_mgpu's
TuningConfig). Unavailable ones are reported as skipped, with why; one that fails
to compile or run is reported with its error and the rest still run. Bytes moved = q + output + the
K/V of every sequence's kv_len keys (each read once); FLOPs = 4 * N * H * (visible keys summed over
queries). The roofline is --peak_bandwidth_gbs / --peak_tflops, or a table entry for the device
kind. Prints a table and writes --json_out.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from absl import app, flags

flags.DEFINE_list(
    "implementations",
    [
        "reference",
        "model_reference",
        "cpu",
        "tpu",
        "gpu",
        "mgpu",
        "jax_tpu",
        "jax_gpu",
        "jax_gpu_mha",
        "jax_gpu_fa3",
        "cudnn",
        "flash_tpu",
        "flash_gpu",
        "flash_mgpu",
    ],
    "Implementations to time (see the module docstring).",
)
flags.DEFINE_list("batches", ["decode", "prefill", "mixed"], "Batch kinds to time.")
flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16"], "Default: bfloat16 on GPU/TPU, f32 on CPU."
)
flags.DEFINE_integer("num_kv_heads", 8, "K (llama3-8b: 8).")
flags.DEFINE_integer("num_queries_per_kv", 4, "Query heads per kv head (llama3-8b: 4).")
flags.DEFINE_integer("head_dim", 128, "H.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("num_decodes", None, "Decode batch: sequences (default 64, CPU 8).")
flags.DEFINE_integer(
    "decode_kv_len", None, "Decode batch: context per sequence (default 2048, CPU 256)."
)
flags.DEFINE_integer(
    "prefill_len", None, "Prefill batch: one chunk of this many tokens (default 2048, CPU 256)."
)
flags.DEFINE_bool("interpret", False, "Run Pallas kernels in interpret mode off their platform.")
flags.DEFINE_integer(
    "iters", 10, "Calls per timing round, issued back to back (one sync at the end of a round)."
)
flags.DEFINE_integer("rounds", 5, "Timing rounds per implementation and batch (median reported).")
flags.DEFINE_multi_string(
    "variant", [], "IMPL:key=value,...: an implementation with kernel arguments (block sizes)."
)
flags.DEFINE_float("peak_bandwidth_gbs", None, "Roofline memory bandwidth (GB/s).")
flags.DEFINE_float("peak_tflops", None, "Roofline compute (TFLOP/s) for the dtype.")
flags.DEFINE_bool(
    "measure_roofline",
    False,
    "Also measure this device's achievable ceilings (a large copy's GB/s, read + write; a large "
    "matmul's TFLOP/s in --dtype) and report each kernel against them too.",
)
flags.DEFINE_string("json_out", "out/bench_kernels.json", "Where to write results ('' = nowhere).")

FLAGS = flags.FLAGS

# (HBM GB/s, dense bf16 TFLOP/s) from the vendors' data sheets.
ROOFLINES = {
    "NVIDIA H200": (4800.0, 989.0),
    "NVIDIA H100 80GB HBM3": (3350.0, 989.0),
    "NVIDIA A100-SXM4-80GB": (2039.0, 312.0),
    "TPU v4": (1200.0, 275.0),
    "TPU v5 lite": (819.0, 197.0),
    "TPU v5e": (819.0, 197.0),
    "TPU v5p": (2765.0, 459.0),
    "TPU v6 lite": (1640.0, 918.0),
}


def batch_specs(kind: str, on_cpu: bool) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) of a batch kind."""
    n = FLAGS.num_decodes or (8 if on_cpu else 64)
    kv = FLAGS.decode_kv_len or (256 if on_cpu else 2048)
    chunk = FLAGS.prefill_len or (256 if on_cpu else 2048)
    if kind == "decode":
        return [1] * n, [kv] * n
    if kind == "prefill":
        return [chunk], [chunk]
    if kind == "mixed":  # decodes beside a chunk that continues a prompt
        return [1] * (n // 2) + [chunk // 2], [kv] * (n // 2) + [chunk]
    raise app.UsageError(f"unknown batch kind {kind!r}")


def make_case(q_lens, kv_lens):
    """A random case (kernels_pallas/ragged_paged_attention/cases.py) padded like the engine pads
    a step."""
    import numpy as np

    from kernels_pallas.ragged_paged_attention.cases import make_case

    T = 1 << max(3, (sum(q_lens) - 1).bit_length())  # the engine's power-of-two token bucket
    case = make_case(
        q_lens,
        kv_lens,
        page_size=FLAGS.page_size,
        num_kv_heads=FLAGS.num_kv_heads,
        num_queries_per_kv=FLAGS.num_queries_per_kv,
        head_dim=FLAGS.head_dim,
        dtype=np.float32,
        num_tokens=T,
        max_num_seqs=min(T, max(len(q_lens), 1)),
    )
    return case


def cost(q_lens, kv_lens, itemsize) -> tuple[float, float]:
    """(bytes moved, FLOPs) of one call."""
    K, Q, H = FLAGS.num_kv_heads, FLAGS.num_queries_per_kv, FLAGS.head_dim
    N = K * Q
    tokens = sum(q_lens)
    kv_bytes = sum(kv_lens) * K * H * 2 * itemsize
    q_out_bytes = 2 * tokens * N * H * itemsize
    visible = sum(
        sum(k - q + i + 1 for i in range(q)) for q, k in zip(q_lens, kv_lens, strict=True)
    )
    return kv_bytes + q_out_bytes, 4.0 * N * H * visible


def _interpret(impl: str, platform: str):
    """Whether kernel `impl` ('tpu', 'gpu' or 'mgpu') runs interpreted here, or why it is
    skipped."""
    from kernels_pallas.platforms import COMPILES_ON

    if platform in COMPILES_ON[impl]:
        return False
    if FLAGS.interpret:
        return True
    return f"compiles only on {COMPILES_ON[impl][0]} (--interpret to run it interpreted)"


def parse_variant(spec: str) -> tuple[str, dict]:
    """'gpu:block_q=1,num_warps=4' -> ('gpu', {'block_q': 1, 'num_warps': 4})."""
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise app.UsageError(f"--variant {spec!r}: want key=value, got {item!r}")
        kwargs[key.strip()] = int(value)
    if name not in ("tpu", "gpu", "mgpu", "flash_tpu", "flash_gpu", "flash_mgpu", "jax_gpu",
                    "jax_gpu_fa3"):  # fmt: skip
        raise app.UsageError(f"--variant {spec!r}: only the Pallas kernels take block sizes")
    return name, kwargs


def _dense_prompt_kv(case, q, k, v, page_indices):
    """The prompt's own K/V, dense [T, K, H] (as the new tokens' projections are), out of its
    pages; None unless the case is one prompt with no cache hit."""
    import jax.numpy as jnp

    n = int(case.cu_q_lens[1])
    if int(case.num_seqs[0]) != 1 or n != int(case.kv_lens[0]):
        return None
    T, (_, G, K, H) = q.shape[0], k.shape
    pages = page_indices[0, : -(-n // G)]
    return n, [
        jnp.zeros((T, K, H), q.dtype).at[:n].set(x[pages].reshape(-1, K, H)[:n]) for x in (k, v)
    ]


def implementation(name: str, platform: str, case, args: list, scale: float, kernel_kw=None):
    """(jitted fn, its args) for one implementation on `case`, or a string saying why it is
    skipped. Inputs in another layout (JAX's kernels, dense K/V for flash prefill) are made here,
    once, so the timed call does only the attention. `kernel_kw` (block sizes) go to our kernel
    function directly (jax_gpu: to JAX's paged_attention)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.flash_prefill import flash_prefill_attention
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention
    from kernels_pallas.ragged_paged_attention.reference import query_positions
    from llmjax.model.attention import paged_attention_reference

    q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs = args
    if name in ("reference", "tpu", "gpu", "mgpu"):
        interpret = None if name == "reference" else _interpret(name, platform)
        if isinstance(interpret, str):
            return interpret
        if name == "mgpu" and q.dtype not in (jnp.bfloat16, jnp.float16):
            return f"the Mosaic GPU kernel takes bfloat16/float16, not {q.dtype} (--dtype)"
        if kernel_kw:
            if name == "mgpu":
                from kernels_pallas.ragged_paged_attention.kernel_mgpu import (
                    ragged_paged_attention_mgpu as kernel,
                )
            elif name == "gpu":
                from kernels_pallas.ragged_paged_attention.kernel_gpu import (
                    ragged_paged_attention_gpu as kernel,
                )
            else:
                from kernels_pallas.ragged_paged_attention.kernel_tpu import (
                    ragged_paged_attention_tpu as kernel,
                )
            fn = functools.partial(kernel, sm_scale=scale, interpret=interpret, **kernel_kw)
            return jax.jit(fn), args
        fn = functools.partial(
            ragged_paged_attention, sm_scale=scale, implementation=name, interpret=interpret
        )
        return jax.jit(fn), args
    if name == "cpu":
        if platform != "cpu":
            return "the C++ kernel runs on the CPU only"
        import kernels_cpu

        if not kernels_cpu.available():
            return "the CPU kernels do not build here (no C++ compiler?)"
        fn = functools.partial(kernels_cpu.ragged_paged_attention, sm_scale=scale)
        return jax.jit(fn), args
    if name == "model_reference":
        _, positions = query_positions(cu_q_lens, kv_lens, q.shape[0])
        fn = functools.partial(paged_attention_reference, scale=scale)
        return jax.jit(fn), (q, k, v, positions, cu_q_lens, page_indices)
    if name in ("flash_tpu", "flash_gpu", "flash_mgpu"):
        impl = name.removeprefix("flash_")
        dense = _dense_prompt_kv(case, q, k, v, page_indices)
        if dense is None:
            return "flash prefill is for one prompt with no cache hit (the prefill batch)"
        interpret = _interpret(impl, platform)
        if isinstance(interpret, str):
            return interpret
        if impl == "mgpu" and q.dtype not in (jnp.bfloat16, jnp.float16):
            return f"the Mosaic GPU kernel takes bfloat16/float16, not {q.dtype} (--dtype)"
        n, (kd, vd) = dense
        if kernel_kw:
            if impl == "gpu":
                from kernels_pallas.flash_prefill.kernel_gpu import flash_prefill_gpu as kernel
            elif impl == "mgpu":
                from kernels_pallas.flash_prefill.kernel_mgpu import flash_prefill_mgpu as kernel
            else:
                from kernels_pallas.flash_prefill.kernel_tpu import flash_prefill_tpu as kernel
            fn = functools.partial(kernel, sm_scale=scale, interpret=interpret, **kernel_kw)
        else:
            fn = functools.partial(
                flash_prefill_attention, sm_scale=scale, implementation=impl, interpret=interpret
            )
        return jax.jit(fn), (q, kd, vd, jnp.array([n], jnp.int32))
    if name in ("jax_gpu_mha", "jax_gpu_fa3", "cudnn"):
        if platform not in ("gpu", "cuda"):
            return f"{name} runs on CUDA only"
        dense = _dense_prompt_kv(case, q, k, v, page_indices)
        if dense is None:
            return f"{name} is timed on the prefill batch (one prompt, no cache hit)"
        n, (kd, vd) = dense
        qn, kd, vd = q[None, :n], kd[None, :n], vd[None, :n]  # [1, n, heads, H]
        if name == "jax_gpu_fa3":
            from jax.experimental.pallas.ops.gpu import attention_mgpu

            if q.dtype not in (jnp.bfloat16, jnp.float16) or n % 128:
                return "JAX's Mosaic GPU attention takes bf16/f16 and a multiple of 128 tokens"
            tuning = dict(block_q=64, block_kv=64, max_concurrent_steps=2) | (kernel_kw or {})
            config = attention_mgpu.TuningConfig(**tuning, causal=True)
            # No sm_scale argument: q is pre-scaled. JAX 0.11.2's kernel allocates its SMEM
            # tiles as float16 whatever the inputs (bf16 fails to lower: "src had type bfloat16
            # and dst had type float16", H200, 2026-12-04), so it is timed in float16: the same
            # bytes and FLOPs.
            f16 = [x.astype(jnp.float16) for x in (qn * scale, kd, vd)]
            fn = functools.partial(attention_mgpu.attention, config=config)
            return jax.jit(lambda *a: fn(*a).astype(q.dtype)), tuple(f16)
        if name == "cudnn":
            fn = functools.partial(
                jax.nn.dot_product_attention, scale=scale, is_causal=True, implementation="cudnn"
            )
            return jax.jit(fn), (qn, kd, vd)
        from jax.experimental.pallas.ops.gpu.attention import mha

        rep = q.shape[1] // k.shape[2]
        kd, vd = (jnp.repeat(x, rep, axis=2) for x in (kd, vd))
        fn = functools.partial(mha, segment_ids=None, sm_scale=scale, causal=True)
        return jax.jit(fn), (qn, kd, vd)
    if name == "jax_tpu":
        if platform != "tpu":
            return "JAX's TPU ragged paged attention runs on TPU only"
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention as jax_rpa,
        )

        kv = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], -1, k.shape[-1])  # K/V interleaved
        fn = functools.partial(jax_rpa, sm_scale=scale)
        return jax.jit(fn), (q, kv, kv_lens, page_indices, cu_q_lens, num_seqs)
    if name == "jax_gpu":
        if platform not in ("gpu", "cuda"):
            return "JAX's GPU paged attention runs on CUDA only"
        if int(case.cu_q_lens[-1]) != int(case.num_seqs[0]):
            return "JAX's GPU paged attention is decode-only (one query per sequence)"
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_pa

        S = kv_lens.shape[0]
        k_hm, v_hm = jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)  # [K, pages, G, H]
        kw = kernel_kw or {}
        # It splits each page table into k_splits parts of whole compute blocks: pad the table
        # (with page 0; lengths mask it).
        per = kw.get("k_splits", 16) * kw.get("pages_per_compute_block", 8)
        pages = jnp.pad(page_indices, ((0, 0), (0, -page_indices.shape[1] % per)))
        # No sm_scale argument: q is pre-scaled.
        fn = functools.partial(jax_pa, **kw)
        return jax.jit(fn), (q[:S] * scale, k_hm, v_hm, pages, kv_lens)
    return f"unknown implementation {name!r}"


def time_fn(fn, args) -> float:
    """Seconds per call: the median over --rounds of (a round of --iters calls issued back to back,
    one sync at the end) / iters, so host dispatch overlaps the device's work as in serving."""
    import jax
    import numpy as np

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(FLAGS.rounds):
        t = time.perf_counter()
        for _ in range(FLAGS.iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / FLAGS.iters)
    return float(np.median(times))


def measure_roofline(dtype: str) -> tuple[float, float]:
    """(GB/s of a 1 GiB copy counting read + write, TFLOP/s of an 8192^3 matmul) on this device;
    on the CPU smaller sizes."""
    import jax
    import jax.numpy as jnp

    on_cpu = jax.default_backend() == "cpu"
    n = (1 << 24) if on_cpu else (1 << 29)  # elements
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32).astype(dtype)
    copy = jax.jit(lambda a: a * 2)
    s = time_fn(copy, (x,))
    gbs = 2 * x.nbytes / s / 1e9
    m = 1024 if on_cpu else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.float32).astype(dtype)
    s = time_fn(jax.jit(jnp.matmul), (a, a))
    return gbs, 2 * m**3 / s / 1e12


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    dtype = FLAGS.dtype or ("float32" if on_cpu else "bfloat16")
    peak_bw, peak_tf = ROOFLINES.get(device.device_kind, (None, None))
    peak_bw = FLAGS.peak_bandwidth_gbs or peak_bw
    peak_tf = FLAGS.peak_tflops or peak_tf
    scale = FLAGS.head_dim**-0.5
    measured = None
    if FLAGS.measure_roofline:
        measured = measure_roofline(dtype)
        print(
            f"[bench_kernels] measured: copy {measured[0]:.0f} GB/s, matmul {measured[1]:.1f} "
            f"TFLOP/s ({dtype}); data sheet: {peak_bw} GB/s, {peak_tf} TFLOP/s",
            file=sys.stderr,
            flush=True,
        )
    rows, skipped = [], {}
    runs = [(name, name, None) for name in FLAGS.implementations]
    runs += [(spec, *parse_variant(spec)) for spec in FLAGS.variant]
    for kind in FLAGS.batches:
        q_lens, kv_lens = batch_specs(kind, on_cpu)
        case = make_case(q_lens, kv_lens)
        args = [jnp.asarray(a, dtype) for a in (case.q, case.k_pages, case.v_pages)]
        args += [jnp.asarray(a) for a in case.args[3:]]
        nbytes, flops = cost(q_lens, kv_lens, jnp.dtype(dtype).itemsize)
        ref = None  # the specification's output, to check every implementation's
        for label, name, kernel_kw in runs:
            try:
                impl = implementation(name, platform, case, args, scale, kernel_kw)
                if isinstance(impl, str):
                    skipped[f"{kind}/{label}"] = impl
                    continue
                s = time_fn(*impl)
                out = impl[0](*impl[1])
            except Exception as e:  # report it, time the others
                skipped[f"{kind}/{label}"] = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
                print(f"[bench_kernels] {kind} {label} failed: {e}", file=sys.stderr, flush=True)
                continue
            out = out.reshape(-1, *out.shape[-2:])  # dense implementations: [1, n, N, H]
            if name == "reference":
                ref = out
            row = {
                "batch": kind,
                "implementation": label,
                "ms": 1e3 * s,
                "GB/s": nbytes / s / 1e9,
                "TFLOP/s": flops / s / 1e12,
                "tokens": sum(q_lens),
                "kv_tokens": sum(kv_lens),
            }
            if ref is not None:
                n = sum(q_lens)
                err = jnp.abs(out[:n].astype(jnp.float32) - ref[:n].astype(jnp.float32)).max()
                row["max_err_vs_reference"] = float(err)
            if peak_bw:
                row["of_peak_bw"] = row["GB/s"] / peak_bw
            if peak_tf:
                row["of_peak_flops"] = row["TFLOP/s"] / peak_tf
            if measured:
                row["of_measured_bw"] = row["GB/s"] / measured[0]
                row["of_measured_flops"] = row["TFLOP/s"] / measured[1]
            rows.append(row)
            print(
                f"[bench_kernels] {kind:8s} {label:16s} {1e3 * s:9.3f} ms "
                f"{row['GB/s']:8.1f} GB/s {row['TFLOP/s']:8.2f} TFLOP/s "
                f"err {row.get('max_err_vs_reference', float('nan')):.2e}",
                file=sys.stderr,
                flush=True,
            )
    header = ["batch", "implementation", "ms", "GB/s", "of peak BW", "TFLOP/s", "of peak FLOP/s"]
    header.append("max err")
    lines = [
        f"device {device.device_kind} ({platform}), {dtype}, K={FLAGS.num_kv_heads} "
        f"Q={FLAGS.num_queries_per_kv} H={FLAGS.head_dim} page {FLAGS.page_size}; roofline "
        f"{peak_bw or '?'} GB/s, {peak_tf or '?'} TFLOP/s (data sheet)"
        + (f"; measured {measured[0]:.0f} GB/s, {measured[1]:.1f} TFLOP/s" if measured else ""),
    ]
    width = max([len(header[1])] + [len(r["implementation"]) for r in rows])

    def fmt(cells):
        return "  ".join(
            [f"{cells[0]:8s}", f"{cells[1]:{width}s}"] + [f"{c:>14s}" for c in cells[2:]]
        )

    lines.append(fmt(header))
    for r in rows:
        cells = [
            r["batch"],
            r["implementation"],
            f"{r['ms']:.3f}",
            f"{r['GB/s']:.1f}",
            f"{r['of_peak_bw']:.1%}" if "of_peak_bw" in r else "-",
            f"{r['TFLOP/s']:.3f}",
            f"{r['of_peak_flops']:.1%}" if "of_peak_flops" in r else "-",
            f"{r['max_err_vs_reference']:.1e}" if "max_err_vs_reference" in r else "-",
        ]
        lines.append(fmt(cells))
    for key, why in skipped.items():
        lines.append(f"skipped {key}: {why}")
    print("\n".join(lines))
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        doc = {
            "device": device.device_kind,
            "platform": platform,
            "dtype": dtype,
            "roofline": {"GB/s": peak_bw, "TFLOP/s": peak_tf},
            "measured": {"GB/s": measured[0], "TFLOP/s": measured[1]} if measured else None,
            "rows": rows,
            "skipped": skipped,
            "flags": {f.name: f.value for f in FLAGS.get_flags_for_module(sys.argv[0])},
        }
        with open(FLAGS.json_out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
