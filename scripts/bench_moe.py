r"""A mixture-of-experts MLP against a dense MLP of the same active parameters, on this machine.

    python scripts/bench_moe.py                                  # both shapes, 1/16/256 tokens
    python scripts/bench_moe.py --shapes qwen3 --tokens 1,64 --dtype bfloat16

Each shape is one layer's MLP (weights random, inputs random):

  mixtral  D 1024, 8 experts of Fe 2048, top-2      (Mixtral-8x7B's ratios at 1/4 the width)
  qwen3    D 1024, 64 experts of Fe 256, top-8      (Qwen3-MoE's many small experts)

against the dense gated MLP whose hidden dim is k x Fe (the FLOPs one token computes either
way). Per token count T: ms of the jitted MoE MLP (llmjax/model/moe.py: route, sort, three
grouped matmuls by the platform's kernel), of the dense MLP, their ratio, and one grouped
matmul (the gate projection) alone by the platform's kernel (kernels_pallas/grouped_matmul: the
tile loop on the CPU) and by XLA's `ragged_dot`, each beside the same FLOPs as one plain matmul
(how close a grouped matmul comes to a dense one on this backend). "packed" repeats the MoE and
dense MLPs and the grouped projection with the weights packed as the engine packs them on a CPU
([out, in], llmjax/model/quant.py; the experts through llmjax/model/grouped_qdot.py: the C++
grouped kernel at decode sizes, the tile loop over expert views above). Also the bytes of expert
weights a T-token step reads (the experts its tokens touch) against the dense MLP's. Medians of
--repeats runs, variants interleaved; table to stdout, JSON to --json_out.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"mixtral": (1024, 8, 2048, 2), "qwen3": (1024, 64, 256, 8)}  # D, E, Fe, k

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", list(SHAPES), f"Which MLP shapes: {list(SHAPES)}.")
flags.DEFINE_list("tokens", ["1", "16", "256"], "Token counts T.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations.")
flags.DEFINE_integer("repeats", 15, "Timed runs per variant (median).")
flags.DEFINE_string("json_out", "out/bench_moe.json", "Where to write the results.")


def _median_ms(fns: dict, repeats: int) -> dict:
    """Each zero-argument fn (already compiled), run interleaved; median ms."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn().block_until_ready()
            times[k].append(1e3 * (time.perf_counter() - t0))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def bench_shape(name: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.grouped_matmul import default_implementation, grouped_matmul_reference
    from llmjax.config import ModelConfig
    from llmjax.model import quant
    from llmjax.model.grouped_qdot import grouped_qdot
    from llmjax.model.layers import gated_mlp
    from llmjax.model.moe import grouped_matmul, moe_mlp, route, sort_by_expert
    from llmjax.sim.roofline import expected_experts_touched

    D, E, Fe, k = SHAPES[name]
    dtype = jnp.dtype(FLAGS.dtype)
    config = ModelConfig(vocab_size=8, hidden_size=D, intermediate_size=k * Fe, num_layers=1,
                         num_heads=8, num_kv_heads=8, num_experts=E, num_experts_per_tok=k,
                         moe_intermediate_size=Fe, norm_topk_prob=True)  # fmt: skip
    keys = jax.random.split(jax.random.key(0), 8)

    def w(key, shape, fan_in):
        return (jax.random.normal(key, shape) / np.sqrt(fan_in)).astype(dtype)

    moe = {
        "router": w(keys[0], (D, E), D),
        "we_gate": w(keys[1], (E, D, Fe), D),
        "we_up": w(keys[2], (E, D, Fe), D),
        "we_down": w(keys[3], (E, Fe, D), Fe),
    }
    dense = (
        w(keys[4], (D, k * Fe), D),
        w(keys[5], (D, k * Fe), D),
        w(keys[6], (k * Fe, D), k * Fe),
    )
    to_jnp = lambda p: jax.tree.map(jnp.asarray, p)
    host = lambda a: np.asarray(a.astype(jnp.float32))
    packed_moe = {
        "router": moe["router"],
        **{
            n: to_jnp(quant.pack_experts(host(moe[n]), quant.pack_dense))
            for n in moe
            if n != "router"
        },
    }
    packed_moe = {n: jax.tree.map(lambda a: a.astype(dtype), v) if n != "router" else v
                  for n, v in packed_moe.items()}  # fmt: skip
    packed_dense = [to_jnp(quant.pack_dense(np.asarray(d))) for d in dense]
    moe_fn = jax.jit(lambda x: moe_mlp(moe, x, config))
    moe_packed_fn = jax.jit(lambda x: moe_mlp(packed_moe, x, config))
    dense_packed_fn = jax.jit(lambda x: gated_mlp(x, *packed_dense))
    gq_fn = jax.jit(lambda r, s: grouped_qdot(r, packed_moe["we_gate"], s))
    dense_fn = jax.jit(lambda x: gated_mlp(x, *dense))
    gmm_fn = jax.jit(lambda r, s: grouped_matmul(r, moe["we_gate"], s))  # the platform's kernel
    ragged_fn = jax.jit(lambda r, s: grouped_matmul_reference(r, moe["we_gate"], s))
    dot_fn = jax.jit(lambda r: jnp.dot(r, moe["we_gate"][0]))
    rows = []
    for T in (int(t) for t in FLAGS.tokens):
        x = jax.random.normal(keys[7], (T, D)).astype(dtype)
        _, experts = route(x, moe["router"], k, True)
        order, sizes = sort_by_expert(experts, E)
        grouped_rows = x[order // k]  # [T k, D]
        fns = {
            "moe": lambda x=x: moe_fn(x),
            "dense": lambda x=x: dense_fn(x),
            "kernel": lambda r=grouped_rows, s=sizes: gmm_fn(r, s),
            "ragged_dot": lambda r=grouped_rows, s=sizes: ragged_fn(r, s),
            "dot": lambda r=grouped_rows: dot_fn(r),  # the same FLOPs as one [D, Fe] matmul
            "moe_packed": lambda x=x: moe_packed_fn(x),
            "dense_packed": lambda x=x: dense_packed_fn(x),
            "grouped_packed": lambda r=grouped_rows, s=sizes: gq_fn(r, s),
        }
        for fn in fns.values():
            fn().block_until_ready()  # compile
        ms = _median_ms(fns, FLAGS.repeats)
        b = dtype.itemsize
        touched = len(np.unique(np.asarray(experts)))
        rows.append({
            "shape": name, "T": T, "dtype": FLAGS.dtype, **{f"{k_}_ms": v for k_, v in ms.items()},
            "moe_over_dense": ms["moe"] / ms["dense"],
            "packed_moe_over_dense": ms["moe_packed"] / ms["dense_packed"],
            "grouped_packed_over_dot": ms["grouped_packed"] / ms["dot"],
            "ragged_over_dot": ms["ragged_dot"] / ms["dot"],
            "kernel_over_dot": ms["kernel"] / ms["dot"],
            "kernel": default_implementation(),
            "experts_touched": touched,
            "experts_touched_expected": expected_experts_touched(E, k, T),
            "expert_bytes_read": touched * 3 * D * Fe * b,
            "dense_bytes_read": 3 * D * k * Fe * b,
        })  # fmt: skip
    return rows


def main(argv):
    del argv
    import jax

    rows = [r for name in FLAGS.shapes for r in bench_shape(name)]
    print(f"MoE MLP vs dense MLP of the same active parameters, {FLAGS.dtype}, "
          f"{jax.devices()[0].device_kind}, median of {FLAGS.repeats} (ms)")  # fmt: skip
    print(
        f"grouped matmul: the platform's kernel ({rows[0]['kernel']}, "
        "kernels_pallas/grouped_matmul) and ragged_dot, each against one dot of its FLOPs"
    )
    print(f"{'shape':>8} {'T':>4} {'moe':>8} {'dense':>8} {'moe/dense':>9} {'kernel':>8} "
          f"{'ragged_dot':>10} {'dot':>7} {'kernel/dot':>10} {'ragged/dot':>10} {'experts':>8} "
          f"{'weights read':>13} | packed: {'moe':>8} {'dense':>8} {'moe/dense':>9} "
          f"{'grouped':>8} {'grouped/dot':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['shape']:>8} {r['T']:>4} {r['moe_ms']:>8.2f} {r['dense_ms']:>8.2f} "
            f"{r['moe_over_dense']:>8.2f}x {r['kernel_ms']:>8.3f} {r['ragged_dot_ms']:>10.3f} "
            f"{r['dot_ms']:>7.3f} {r['kernel_over_dot']:>9.1f}x {r['ragged_over_dot']:>9.1f}x "
            f"{r['experts_touched']:>3} "
            f"({r['experts_touched_expected']:.1f}) "
            f"{r['expert_bytes_read'] / r['dense_bytes_read']:>12.1f}x | "
            f"        {r['moe_packed_ms']:>8.2f} {r['dense_packed_ms']:>8.2f} "
            f"{r['packed_moe_over_dense']:>8.2f}x {r['grouped_packed_ms']:>8.3f} "
            f"{r['grouped_packed_over_dot']:>10.1f}x"
        )
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
