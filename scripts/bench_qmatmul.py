"""Benchmark of the CPU quantized matmul (kernels_cpu/qmatmul.py) against XLA's float32 and int8
dots, at decode and prefill row counts.

    python scripts/bench_qmatmul.py                                   # the default table
    python scripts/bench_qmatmul.py --shapes 576x1536 --fmts q4_1 --tokens 1,16 --cold
    python scripts/bench_qmatmul.py --out /tmp/qmatmul.json

Implementations, each y[T, out] from x[T, in]:
  int8, q8_0, q4_0, q4_1  the kernel on that weight format (activations quantized inside it)
  xla_f32                 XLA's `x @ w`, w float32 [in, out]
  xla_int8                XLA's int8 dot_general(xq, wq) -> int32, xq int8 [T, in], wq int8
                          [out, in] (the dot alone: no activation quantization or rescale)
Each is timed as `--iters` applications inside one jitted `lax.scan` over as many different x
(so dispatch is amortized and nothing is hoisted), repeated `--repeats` times; the table gives the
median per application in microseconds and the weight bandwidth, weight bytes / time (GB/s).
With one weight the weights stay in cache between applications where they fit (L2 is 2 MB per
core here); `--cold` also times a scan over a stack of different weights (`--cold_bytes` in all)
with each application reading the next one, the DRAM-bound figure (the kernel reads the stack in
place through its `layer` argument; XLA's dots get `stack[i]`, which XLA:CPU copies out first).
Weights are random bytes in each format (the speed does not depend on the values).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_list("shapes", ["576x1536", "1536x576", "576x49152"], "Weights as INxOUT.")
flags.DEFINE_list("fmts", ["int8", "q8_0", "q4_0", "q4_1"], "Kernel weight formats.")
flags.DEFINE_list("baselines", ["xla_f32", "xla_int8"], "XLA baselines (xla_f32, xla_int8).")
flags.DEFINE_list("tokens", ["1", "2", "16", "64", "512"], "Row counts T.")
flags.DEFINE_integer("iters", 20, "Applications per timed call (a scan over different x).")
flags.DEFINE_integer("repeats", 7, "Timed calls per row; the median is reported.")
flags.DEFINE_bool("cold", False, "Also time a scan over a stack of different weights.")
flags.DEFINE_integer("cold_bytes", 1 << 30, "Total bytes of the --cold weight stack.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def make_weights(rng, impl: str, n_in: int, out: int, layers: int):
    """The arrays, with a leading axis of `layers`."""
    import numpy as np

    nb = n_in // 32
    lead = (layers,)
    if impl == "xla_f32":
        arrays = (rng.standard_normal((*lead, n_in, out), dtype=np.float32),)
    elif impl in ("xla_int8", "int8"):
        arrays = (rng.integers(-127, 128, (*lead, out, n_in), dtype=np.int8),)
        if impl == "int8":
            arrays += (rng.random((*lead, out), dtype=np.float32) * 0.01,)
    elif impl == "q8_0":
        arrays = (rng.integers(-127, 128, (*lead, out, n_in), dtype=np.int8),)
        arrays += (rng.random((*lead, out, nb), dtype=np.float32) * 0.01,)
    else:  # q4_0, q4_1
        arrays = (rng.integers(0, 256, (*lead, out, n_in // 2), dtype=np.uint8),)
        arrays += (rng.random((*lead, out, nb), dtype=np.float32) * 0.01,)
        if impl == "q4_1":
            arrays += (rng.random((*lead, out, nb), dtype=np.float32) * -0.05,)
    return arrays


def weight_bytes(impl: str, n_in: int, out: int) -> int:
    """Bytes of one layer's weight arrays."""
    nb = n_in // 32
    return {
        "xla_f32": 4 * n_in * out,
        "xla_int8": n_in * out,
        "int8": n_in * out + 4 * out,
        "q8_0": n_in * out + 4 * out * nb,
        "q4_0": n_in * out // 2 + 4 * out * nb,
        "q4_1": n_in * out // 2 + 8 * out * nb,
    }[impl]


def apply_fn(impl: str):
    """f(x [T, in] float32, layer index or None (the only one), *stacked weights) -> y [T, out]."""
    import jax
    import jax.numpy as jnp

    from kernels_cpu.qmatmul import qmatmul

    pick = lambda w, i: w[0] if i is None else w[i]  # w[0] of one layer: a bitcast
    if impl == "xla_f32":
        return lambda x, i, w: x @ pick(w, i)
    if impl == "xla_int8":
        dims = (((1,), (1,)), ((), ()))
        return lambda x, i, w: jax.lax.dot_general(
            x.astype(jnp.int8), pick(w, i), dims, preferred_element_type=jnp.int32
        )

    def kernel(x, i, *w):
        if i is None:
            w = [a[0] for a in w]
        v, s, *m = w
        return qmatmul(x, v, s, *m, fmt=impl, layer=i)

    return kernel


def time_impl(impl: str, n_in: int, out: int, T: int, layers: int) -> float:
    """Median microseconds per application."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    weights = [jnp.asarray(w) for w in make_weights(rng, impl, n_in, out, layers)]
    steps = max(FLAGS.iters, layers)  # application i takes x[i % iters] and layer i % layers
    xs = jnp.asarray(rng.standard_normal((FLAGS.iters, T, n_in), dtype=np.float32))
    if impl == "xla_int8":  # the dot's int8 activations, made outside the timed dot
        xs = jnp.clip(jnp.round(xs * 40), -127, 127)
    f = apply_fn(impl)

    @jax.jit
    def run(xs, *w):
        def body(carry, i):
            x = xs[i % FLAGS.iters]
            return f(x, None if layers == 1 else i % layers, *w), None

        init = jnp.zeros((T, out), jnp.int32 if impl == "xla_int8" else jnp.float32)
        return jax.lax.scan(body, init, jnp.arange(steps))[0]

    run(xs, *weights).block_until_ready()
    times = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        run(xs, *weights).block_until_ready()
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times)) * 1e6


def main(argv):
    del argv
    import kernels_cpu

    kernels_cpu.load()
    impls = [*FLAGS.fmts, *FLAGS.baselines]
    results = []
    for shape in FLAGS.shapes:
        n_in, out = (int(s) for s in shape.split("x"))
        for mode in ["warm", "cold"] if FLAGS.cold else ["warm"]:
            for T in (int(t) for t in FLAGS.tokens):
                row = {"in": n_in, "out": out, "T": T, "mode": mode}
                for impl in impls:
                    nbytes = weight_bytes(impl, n_in, out)
                    layers = max(2, FLAGS.cold_bytes // nbytes) if mode == "cold" else 1
                    us = time_impl(impl, n_in, out, T, layers)
                    row[impl] = {"us": us, "gbs": nbytes / us / 1e3, "weight_bytes": nbytes}
                results.append(row)
                print_row(row, impls, header=len(results) == 1)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"impls": impls, "results": results}, f, indent=1)


def print_row(row, impls, header: bool):
    if header:
        print("| in x out | mode | T | " + " | ".join(f"{i} us (GB/s)" for i in impls) + " |")
        print("|---" * (3 + len(impls)) + "|")
    cells = [f"{row[i]['us']:.1f} ({row[i]['gbs']:.1f})" for i in impls]
    print(
        f"| {row['in']}x{row['out']} | {row['mode']} | {row['T']} | " + " | ".join(cells) + " |",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main)
