"""The device mesh, the one logical-axis -> mesh-axis rules table, and weight placement.

Every weight's `ParamSpec` (llmjax/model/params.py) names its axes (`vocab`, `embed`, `q_heads`,
`kv_heads`, `head_dim`, `mlp`, `experts`, `expert_mlp`); `SHARDING_RULES` maps them to mesh
axes, and that table alone decides the tensor- and expert-parallel layout (Megatron's):
  wq, wk, wv [D, heads, H]  column-parallel (split over heads)
  wo [N, H, D]              row-parallel: the attention output is a partial sum -> all-reduce
  w_gate, w_up [D, F]       column-parallel; w_down [F, D] row-parallel -> all-reduce
  embed [V, D], lm_head     split over the vocabulary
  norms, router             replicated
  we_* [E, D, Fe]           experts split over 'ep', each expert's hidden dim over 'tp'
XLA's SPMD partitioner inserts the collectives; the attention kernels run per device on the local
heads (shard_map, llmjax/model/attention.py), and under expert parallelism the experts run per
device on their own tokens (shard_map with all-to-all, llmjax/model/moe.py). An axis whose size
the mesh axes do not divide (a vocabulary of 49153 at tp=2, say) stays replicated, and the log
says so.

Mesh axes: ('pp', 'ep', 'tp') of sizes (pp, ep, tp / ep): pipeline stages x the tensor-parallel
devices, which are ParallelConfig.tp = ep x (tp / ep) devices. Everything tensor-parallel (heads,
vocabulary, a dense MLP) splits over both of the last two axes, `TP_AXES`; the experts split over
'ep' and their hidden dims over the rest. With ep = 1 (every dense model) the 'ep' axis has size
1 and the layout is plain Megatron TP. Auto axis types (GSPMD).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmjax.config import ModelConfig, ParallelConfig
from llmjax.model.kv_cache import QuantizedPages
from llmjax.model.params import ParamSpec, map_specs, param_specs, unstack_layers
from llmjax.parallel.heads import HeadLayout, transform_weight

logger = logging.getLogger(__name__)

MESH_AXES = ("pp", "ep", "tp")
TP_AXES = ("ep", "tp")  # the tensor-parallel devices: ParallelConfig.tp of them

# Logical axis -> mesh axis or axes (None: replicated). The only place the layout is written.
SHARDING_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,  # the stacked layout's leading axis (llmjax/model/params.py)
    "vocab": TP_AXES,
    "embed": None,
    "q_heads": TP_AXES,
    "kv_heads": TP_AXES,
    "head_dim": None,
    "mlp": TP_AXES,
    "experts": "ep",  # stacked experts [E, ...]: E / ep whole experts per expert group
    "expert_mlp": "tp",  # an expert's hidden dim: split over the devices of its group
    "router": None,  # the router's expert scores [D, E]: replicated
}

# KV pages [num_pages, page_size, K, H]: split by kv head, like wk/wv (stacked: the same, with
# every layer's pages on the first axis).
KV_PAGES_AXES = (None, None, "kv_heads", "head_dim")


def too_few_devices(what: str, n: int, devices) -> ValueError:
    """The error for `what` needing `n` devices where only `devices` are (with the CPU hint)."""
    platform = devices[0].platform if devices else "?"
    hint = (
        " (on a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)"
        if platform == "cpu"
        else ""
    )
    return ValueError(
        f"{what} {n} devices; {len(devices)} {platform} device(s) are available{hint}"
    )


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A (pp, ep, tp / ep) mesh over the first pp * tp of `devices` (default: all processes'
    devices)."""
    devices = list(jax.devices() if devices is None else devices)
    n = parallel.pp * parallel.tp
    if n > len(devices):
        raise too_few_devices(
            f"ParallelConfig(tp={parallel.tp}, pp={parallel.pp}) needs", n, devices
        )
    return jax.make_mesh(
        (parallel.pp, parallel.ep, parallel.tp // parallel.ep),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices[:n],
    )


def mesh_axes_size(mesh: Mesh, axes) -> int:
    """The number of devices along mesh axis `axes` (a name or a tuple of names; None: 1)."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape.get(a, 1) for a in names]))


def _live_axes(mesh: Mesh, axes):
    """`axes` without the mesh axes of size 1: a name, a tuple of names, or None."""
    if axes is None:
        return None
    names = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if mesh.shape[a] > 1)
    return None if not names else names[0] if len(names) == 1 else names


def partition_spec(shape, logical_axes, mesh: Mesh, rules=None, name: str = "") -> P:
    """The PartitionSpec of an array with these logical axes: each axis goes to its mesh axes
    (those of size > 1) when they divide it, else it is replicated (logged once per weight)."""
    rules = SHARDING_RULES if rules is None else rules
    out = []
    for size, axis in zip(shape, logical_axes, strict=True):
        mesh_axis = _live_axes(mesh, rules.get(axis))
        n = mesh_axes_size(mesh, mesh_axis)
        if mesh_axis is not None and size % n:
            logger.info(
                "%s: %s axis of size %d not divisible by %s=%d; replicated",
                name or "array",
                axis,
                size,
                mesh_axis,
                n,
            )
            mesh_axis = None
        out.append(mesh_axis)
    return P(*out)


def param_shardings(config: ModelConfig, mesh: Mesh, rules=None, stacked: bool = False):
    """NamedSharding for every weight of `config` (the tree of `param_specs`, either layout)."""

    def one(spec: ParamSpec) -> NamedSharding:
        return NamedSharding(mesh, partition_spec(spec.shape, spec.logical_axes, mesh, rules))

    return map_specs(one, param_specs(config, stacked=stacked))


def kv_pages_sharding(
    config: ModelConfig,
    mesh: Mesh,
    num_pages: int,
    page_size: int,
    stacked: bool = False,
    kv_cache_dtype: str = "auto",
    num_slots: int | None = None,
):
    """The sharding of one layer's KV pages, or (`stacked`) of the stacked cache's
    ([slots * num_pages, ...]: the same axes; `num_slots` layer slots, default L); for a quantized
    `kv_cache_dtype` a `QuantizedPages` of the values' sharding and the scales' ([P, G, K, 1]:
    split as the values)."""
    if stacked:
        num_pages *= config.num_layers if num_slots is None else num_slots
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    spec = partition_spec(shape, KV_PAGES_AXES, mesh, name="kv_pages")
    if kv_cache_dtype == "auto":
        return NamedSharding(mesh, spec)
    scales = P(*(tuple(spec) + (None,) * 4)[:3], None)
    return QuantizedPages(NamedSharding(mesh, spec), NamedSharding(mesh, scales), kv_cache_dtype)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(x, sharding: NamedSharding) -> jax.Array:
    """An array (the same on every process) -> a global array with `sharding`; each device
    receives only its own shard. Across processes, `make_array_from_callback` asks for the slices
    of this process's devices only."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place_params(
    params, config: ModelConfig, layout: HeadLayout, mesh: Mesh, dtype=None, stacked: bool = False
):
    """Original-layout weights -> the device layout (`layout`, heads.py), placed on `mesh` one
    weight at a time. A leaf may be a thunk (a function that loads the weight): it is called
    only when that weight is placed, and its host copy is dropped right after, so the host holds
    one weight at a time and every device receives only its shard. `params` in either layer
    layout (llmjax/model/params.py); the result is stacked with `stacked` (each weight's layers
    placed, then stacked on the devices one weight name at a time)."""
    device_config = layout.model_config(config)
    params = unstack_layers(params)
    shardings = param_shardings(device_config, mesh)
    Q = config.num_heads // config.num_kv_heads

    def one(path, leaf, sharding):
        x = leaf() if callable(leaf) else leaf
        name = str(getattr(path[-1], "key", ""))
        x = transform_weight(name, x, layout, Q)
        if dtype is not None and x.dtype != dtype:
            x = x.astype(dtype)
        return place(x, sharding)

    placed = jax.tree_util.tree_map_with_path(one, params, shardings)
    if not stacked:
        return placed
    stacked_shardings = param_shardings(device_config, mesh, stacked=True)["layers"]
    layers = placed["layers"]
    out = {}
    for name, sharding in stacked_shardings.items():
        per_layer = [layer.pop(name) for layer in layers]  # dropped once stacked
        out[name] = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*per_layer)
    return {**placed, "layers": out}


# The LoRA slots' split (llmjax/model/lora.py): as the base weight each attaches to, column-
# parallel targets along B's output, row-parallel ones along A's input; the rank replicated.
_LORA_AXES = {
    "wq": ("b", "q_heads"),
    "wk": ("b", "kv_heads"),
    "wv": ("b", "kv_heads"),
    "w_gate": ("b", "mlp"),
    "w_up": ("b", "mlp"),
    "wo": ("a", "q_heads"),
    "w_down": ("a", "mlp"),
}


def lora_shardings(lora: dict, mesh: Mesh) -> dict:
    """NamedShardings for `params["lora"]` ({"columns": [S R], name: (a [L, in, S R],
    b [L, S R, out])}) on `mesh`."""
    out = {"columns": replicated(mesh)}
    for name, (a, b) in ((n, w) for n, w in lora.items() if n != "columns"):
        side, axis = _LORA_AXES[name]
        a_axes = ("layers", axis if side == "a" else None, None)
        b_axes = ("layers", None, axis if side == "b" else None)
        out[name] = (
            NamedSharding(mesh, partition_spec(a.shape, a_axes, mesh, name=f"lora {name} A")),
            NamedSharding(mesh, partition_spec(b.shape, b_axes, mesh, name=f"lora {name} B")),
        )
    return out
