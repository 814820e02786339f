"""Benchmark of the CPU dense matmul (kernels_cpu/dense_matmul.py) against XLA's float dots, at
decode and prefill row counts, with the weights cold in cache.

    python scripts/bench_dense_matmul.py                        # the default table
    python scripts/bench_dense_matmul.py --shapes 576x49152 --tokens 1,16 \
        --impls kernel_bf16,xla_f32
    python scripts/bench_dense_matmul.py --warm --out /tmp/dense.json

Implementations, each y[T, out] float32 from x[T, in] float32:
  kernel_f32    dense_matmul(x, w), w float32 [out, in]
  kernel_bf16   dense_matmul(x, w), w bfloat16 [out, in] (x rounded to bf16 inside)
  kernel_i8     dense_matmul(x, w), w int8 codes [out, in] (weight-only int8: float32 sums of
                float32 x times the widened codes; the scales are the caller's)
  kernel_i8_a16 dense_matmul(x, w, round_x=True), w int8 codes (W8A16, quantization='int8':
                x's bfloat16 values; from 8 tokens the codes widened onto the AMX bf16 tiles)
  xla_f32       XLA's x @ w, w float32 [in, out]
  xla_f32_oi    XLA's dot_general(x, w, (((1,), (1,)), ((), ()))), w float32 [out, in]
  xla_bf16_oi   the same on bfloat16 x and w [out, in], preferred_element_type float32
  xla_bf16_f32_oi  bfloat16 x and w [out, in] widened to float32 in the program, then XLA's
                float32 dot (what the model does for bf16 weights at prefill sizes on CPUs
                without bf16 dot instructions)
A kernel's name may end in @TILE to run the AVX2 engine with that register tile from 3 tokens on
(tokens * 10 + outputs: 24, 42, 33, 34, 43; the library's default otherwise), e.g.
--impls kernel_f32@24,kernel_f32@34 compares two tiles in one run.

Cold (the default): one jitted program applies the matmul to `n` different weights in turn
(separate arrays, the program unrolled, so that XLA reads each weight where it is, as the kernel
does), n = cold_bytes / (one weight's bytes), at least --min_weights (at most --max_weights and
--max_bytes in all): the weights together
overflow the caches (the last level is large here: 30 layers of a [576, 1536] float32 weight,
106 MB, still partly hit it), so each application streams its weight from DRAM, as a model
step does. Each application's x depends on the previous y (x_i + 1e-30 y_{i-1}[:, :1], a
small elementwise op, in every implementation alike), so they run one after another. --warm
instead applies one weight over and over (it stays in cache where it fits: L2 is 2 MB per
core). The implementations are timed in turn, --repeats rounds (all their weights are made
first), so that a shared machine's load falls on them alike; each timed call follows --settle
untimed ones of the same implementation, as what ran before can slow a call down (after XLA's
slow bf16 dot at T = 1, the kernel's chain at T = 1 ran ~1.5x slower, at about what one core
alone streams, ~15 GB/s: probably the thread pool's helpers, asleep, joining late). The table
gives the median time per application (us), the weight bandwidth, weight bytes / time (GB/s),
and the 1-minute load average while timing (other processes' share of the machine); the JSON
(--out) every time and n.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMPLS = (
    "kernel_f32",
    "kernel_bf16",
    "kernel_i8",
    "kernel_i8_a16",
    "xla_f32",
    "xla_f32_oi",
    "xla_bf16_oi",
    "xla_bf16_f32_oi",
)

flags.DEFINE_list("shapes", ["576x1536", "1536x576", "576x49152"], "Weights as INxOUT.")
flags.DEFINE_list("impls", list(IMPLS), f"Implementations, of {IMPLS}.")
flags.DEFINE_list("tokens", ["1", "2", "8", "16", "32", "64", "128", "512"], "Row counts T.")
flags.DEFINE_integer("repeats", 7, "Timed calls per cell; the median is reported.")
flags.DEFINE_integer("settle", 1, "Untimed calls before each timed one (see the docstring).")
flags.DEFINE_bool("warm", False, "One weight, reused (cache-warm), instead of cold weights.")
flags.DEFINE_integer("cold_bytes", 512 << 20, "Cold: the weights' total bytes, at least.")
flags.DEFINE_integer("min_weights", 30, "Cold: distinct weights, at least.")
flags.DEFINE_integer("max_weights", 320, "Cold: distinct weights, at most.")
flags.DEFINE_integer(
    "max_bytes", 768 << 20, "Cold: the weights' total bytes per implementation, at most."
)
flags.DEFINE_string("out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def weight_spec(impl: str, n_in: int, out: int):
    """(shape, dtype) of the implementation's weight."""
    import jax.numpy as jnp

    impl = impl.partition("@")[0]
    if impl == "xla_f32":
        return (n_in, out), jnp.float32
    if impl.startswith("kernel_i8"):
        return (out, n_in), jnp.int8
    return (out, n_in), jnp.bfloat16 if "bf16" in impl else jnp.float32


def apply_fn(impl: str):
    """f(x [T, in] float32, w) -> y [T, out] float32."""
    import jax
    import jax.numpy as jnp

    from kernels_cpu.dense_matmul import dense_matmul

    dims = (((1,), (1,)), ((), ()))
    impl = impl.partition("@")[0]
    if impl in ("kernel_f32", "kernel_bf16", "kernel_i8"):
        return dense_matmul
    if impl == "kernel_i8_a16":
        return lambda x, w: dense_matmul(x, w, round_x=True)
    if impl == "xla_f32":
        return lambda x, w: x @ w
    if impl == "xla_f32_oi":
        return lambda x, w: jax.lax.dot_general(x, w, dims)
    if impl == "xla_bf16_f32_oi":
        return lambda x, w: jax.lax.dot_general(
            x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.float32), dims
        )
    if impl == "xla_bf16_oi":
        return lambda x, w: jax.lax.dot_general(
            x.astype(jnp.bfloat16), w, dims, preferred_element_type=jnp.float32
        )
    raise ValueError(f"unknown impl {impl!r}; want one of {IMPLS}")


def make_weights(impl: str, n_in: int, out: int, n: int):
    """n different weights (separate arrays), uniform in [-1, 1) (int8: codes in [-127, 127])."""
    import jax
    import jax.numpy as jnp

    shape, dtype = weight_spec(impl, n_in, out)
    scale = 127.0 if dtype == jnp.int8 else 1.0
    make = jax.jit(
        lambda k: (
            jnp.rint(scale * jax.random.uniform(k, shape, minval=-1.0, maxval=1.0)).astype(dtype)
            if dtype == jnp.int8
            else jax.random.uniform(k, shape, minval=-1.0, maxval=1.0).astype(dtype)
        )
    )
    keys = jax.random.split(jax.random.key(0), n)
    return [make(k).block_until_ready() for k in keys]


def chain_fn(impl: str, ws, n_in: int, out: int, T: int, steps: int):
    """(run, xs): run(xs, ws) applies the implementation `steps` times, cycling over ws."""
    import jax
    import jax.numpy as jnp

    f = apply_fn(impl)
    xs = jax.random.normal(jax.random.key(1), (min(steps, 8), T, n_in), jnp.float32)

    @jax.jit
    def run(xs, ws):
        y = jnp.zeros((T, out), jnp.float32)
        for i in range(steps):
            y = f(xs[i % len(xs)] + 1e-30 * y[:, :1], ws[i % len(ws)])
        return y

    run(xs, ws).block_until_ready()  # compiled, and the weights touched once
    return run, xs


def num_weights(nbytes: int) -> int:
    """Cold: distinct weights of nbytes each, so that they hold cold_bytes (min_weights at least,
    max_weights and max_bytes at most)."""
    n = max(FLAGS.min_weights, -(-FLAGS.cold_bytes // nbytes))
    return max(2, min(n, FLAGS.max_weights, FLAGS.max_bytes // nbytes))


def main(argv):
    del argv
    import jax.numpy as jnp
    import numpy as np

    import kernels_cpu

    library = ctypes.cdll.LoadLibrary(kernels_cpu.load())

    def set_tile(impl: str) -> None:  # the AVX2 engine's tile for this implementation's calls
        tile = int(impl.partition("@")[2] or 0)
        if not library.LlmjaxDenseMatmulSetAvx2Tile(tile) and tile:
            raise app.UsageError(f"{impl}: this CPU's kernels have no AVX2 engine")

    for impl in FLAGS.impls:
        apply_fn(impl)  # unknown names fail now
        set_tile(impl)
    tokens = [int(t) for t in FLAGS.tokens]
    results = []
    for shape in FLAGS.shapes:
        n_in, out = (int(s) for s in shape.split("x"))
        weights, counts, sizes = {}, {}, {}
        for impl in FLAGS.impls:
            _, dtype = weight_spec(impl, n_in, out)
            sizes[impl] = n_in * out * jnp.dtype(dtype).itemsize
            counts[impl] = 1 if FLAGS.warm else num_weights(sizes[impl])
            weights[impl] = make_weights(impl, n_in, out, counts[impl])
        rows = []
        for T in tokens:
            steps = {i: 20 if FLAGS.warm else counts[i] for i in FLAGS.impls}
            runs = {}
            for i in FLAGS.impls:
                set_tile(i)
                runs[i] = chain_fn(i, weights[i], n_in, out, T, steps[i])
            times = {i: [] for i in FLAGS.impls}
            load = []
            for _ in range(FLAGS.repeats):  # the implementations in turn: the same conditions
                load.append(os.getloadavg()[0])
                for impl, (run, xs) in runs.items():
                    set_tile(impl)
                    for _ in range(FLAGS.settle):
                        run(xs, weights[impl]).block_until_ready()
                    t0 = time.perf_counter()
                    run(xs, weights[impl]).block_until_ready()
                    times[impl].append((time.perf_counter() - t0) / steps[impl] * 1e6)
            row = {
                "in": n_in,
                "out": out,
                "T": T,
                "mode": "warm" if FLAGS.warm else "cold",
                "loadavg_1min": float(np.median(load)),
            }
            for impl in FLAGS.impls:
                us = float(np.median(times[impl]))
                row[impl] = {
                    "us": us,
                    "gbs": sizes[impl] / us / 1e3,
                    "weight_bytes": sizes[impl],
                    "weights": counts[impl],
                    "times_us": times[impl],
                }
            rows.append(row)
            del runs
            times = ", ".join(f"{i} {row[i]['us']:.1f} us" for i in FLAGS.impls)
            print(f"  {shape} T={T}: {times}", file=sys.stderr, flush=True)
        del weights
        results += rows
        print_table(rows, FLAGS.impls)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"impls": FLAGS.impls, "results": results}, f, indent=1)


def print_table(rows, impls):
    print("\n| in x out | mode | T | " + " | ".join(f"{i} us (GB/s)" for i in impls) + " | load |")
    print("|---" * (4 + len(impls)) + "|")
    for row in rows:
        cells = [f"{row[i]['us']:.1f} ({row[i]['gbs']:.1f})" for i in impls]
        print(
            f"| {row['in']}x{row['out']} | {row['mode']} | {row['T']} | "
            + " | ".join(cells)
            + f" | {row['loadavg_1min']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
