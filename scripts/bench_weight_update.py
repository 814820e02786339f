r"""The time of `LLM.update_weights` against loading the checkpoint again (issue 43).

    python scripts/bench_weight_update.py                 # SmolLM2 on this CPU, then simulated

On this machine (--model, float32): the trainer's weights (jax arrays on the device, llmjax's
layout) pushed into a running engine with `update_weights`, from host numpy arrays, and by HF
names, each --repeats times (the median; the first call warms up), against building a fresh
`LLM` from the checkpoint (read, dequantize, pack, place: what a reload costs; compiling comes on
top of it and is not counted). The ratio is reload / update, measured in the same run.

Simulated (the simulator's memory model, llmjax/sim/hardware.py; no device involved): for each
--sim_models preset at tp = --sim_tp on --hardware, in bfloat16: an update moves each device's
shard of the trainer's weights over the intra-node link (the trainer's layout is not the
engine's: at worst every byte of the shard crosses) and writes it once in HBM; a reload reads
the checkpoint from disk (--disk_gbps per node) and copies each shard from the host over PCIe
(`Hardware.host_bandwidth`). Table to stdout, JSON to --json_out.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset or checkpoint for the CPU part.")
flags.DEFINE_integer("repeats", 5, "Timed updates per source (the median is reported).")
flags.DEFINE_list("sim_models", ["llama2-7b", "llama2-13b", "llama2-70b"], "Simulated presets.")
flags.DEFINE_integer("sim_tp", 8, "Tensor parallelism of the simulated engines.")
flags.DEFINE_string("hardware", "a100-80gb", "The simulated device.")
flags.DEFINE_float("disk_gbps", 5.0, "Checkpoint read rate per node, GB/s (NVMe), simulated.")
flags.DEFINE_string("json_out", "out/bench_weight_update.json", "Where to write the results.")


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (the first update packs through freshly traced ops)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def cpu_part(model: str, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from llmjax import LLM
    from llmjax.checkpoint.hf import hf_tensors_from_params
    from llmjax.loading import load
    from llmjax.model.params import num_params

    t = time.perf_counter()
    llm = LLM(model, compilation_cache_dir="", max_model_len=256)
    reload_s = time.perf_counter() - t
    config, params, _ = load(model, "float32", "auto", None)
    on_device = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    hf = hf_tensors_from_params(config, params, np.float32)
    compiles = llm.engine.num_compiles
    rows = {}
    for name, fn in (
        ("update_weights (jax arrays)", lambda: llm.update_weights(on_device)),
        ("update_weights (numpy)", lambda: llm.update_weights(params)),
        ("update_weights (HF names)", lambda: llm.update_weights(hf, source_format="hf")),
    ):
        rows[name] = _median_seconds(fn, repeats)
    reload_again = []
    for _ in range(2):  # (a second and third load: the file in the page cache)
        t = time.perf_counter()
        LLM(model, compilation_cache_dir="", max_model_len=256)
        reload_again.append(time.perf_counter() - t)
    reload_s = float(np.median([reload_s, *reload_again]))
    assert llm.engine.num_compiles == compiles
    nbytes = 4 * num_params(config)
    return dict(model=model, weight_bytes=nbytes, reload_s=reload_s, updates=rows,
                num_updates=llm.weight_version)  # fmt: skip


def sim_part(models, tp: int, hardware: str, disk_gbps: float) -> list[dict]:
    import configs
    from llmjax.model.params import num_params
    from llmjax.sim.hardware import get_hardware

    hw = get_hardware(hardware)
    out = []
    for name in models:
        config = configs.get_preset(name)
        nbytes = 2 * num_params(config)  # bfloat16
        shard = nbytes / tp
        link = hw.link_bandwidth * hw.link_efficiency
        hbm = hw.memory_bandwidth * hw.memory_efficiency
        update_s = shard / link + 2 * shard / hbm  # over the link, then written and read once
        nodes = -(-tp // hw.devices_per_node)
        reload_s = nbytes / (disk_gbps * 1e9 * nodes) + shard / hw.host_bandwidth
        out.append(dict(model=name, tp=tp, hardware=hw.name, weight_bytes=nbytes,
                        update_s=update_s, reload_s=reload_s,
                        ratio=reload_s / update_s))  # fmt: skip
    return out


def main(argv):
    del argv
    cpu = cpu_part(FLAGS.model, FLAGS.repeats)
    print(f"{cpu['model']} on this CPU, float32 ({cpu['weight_bytes'] / 1e6:.0f} MB of weights)")
    print(f"{'path':<32} {'seconds':>9} {'reload / it':>12}")
    print(f"{'reload (a fresh LLM)':<32} {cpu['reload_s']:9.3f} {1.0:12.2f}")
    for name, s in cpu["updates"].items():
        print(f"{name:<32} {s:9.3f} {cpu['reload_s'] / s:12.2f}")
    sim = sim_part(FLAGS.sim_models, FLAGS.sim_tp, FLAGS.hardware, FLAGS.disk_gbps)
    print(f"\nsimulated (memory model): bfloat16, tp={FLAGS.sim_tp} on {FLAGS.hardware}, "
          f"checkpoint at {FLAGS.disk_gbps:g} GB/s per node")  # fmt: skip
    print(f"{'model':<14} {'GB':>7} {'update s':>9} {'reload s':>9} {'reload / update':>16}")
    for r in sim:
        print(f"{r['model']:<14} {r['weight_bytes'] / 1e9:7.1f} {r['update_s']:9.3f} "
              f"{r['reload_s']:9.2f} {r['ratio']:16.1f}")  # fmt: skip
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(cpu=cpu, simulated=sim), f, indent=1)


if __name__ == "__main__":
    app.run(main)
