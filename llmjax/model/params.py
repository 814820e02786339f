"""Parameters described once.

Each weight has one `ParamSpec` (shape, logical axes, initializer). From the spec tree follow the
abstract shapes (`abstract_params`), random weights (`init_params`), the checkpoint targets
(`llmjax.checkpoint`) and, later, the sharding on a mesh: tensor parallelism maps logical axes
(`embed`, `q_heads`, `kv_heads`, `mlp`, `vocab`, ...) to mesh axes in one rules table, so no layer
code changes.

Tree layout (L layers; letters as in `llama.py`'s legend):

    {"embed": [V, D],
     "layers": [ {"attn_norm": [D], "wq": [D, N, H], "wk": [D, K, H], "wv": [D, K, H],
                  ("bq": [N, H], "bk": [K, H], "bv": [K, H]  -- with attention_bias)
                  ("q_norm": [H], "k_norm": [H]              -- with qk_norm)
                  "wo": [N, H, D], ("attn_post_norm": [D]    -- with post_norms)
                  "mlp_norm": [D], ("mlp_post_norm": [D]     -- with post_norms)
                  "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]   -- a dense MLP, or
                  "router": [D, E], "we_gate": [E, D, Fe], "we_up": [E, D, Fe],
                  "we_down": [E, Fe, D]                          -- a mixture of E experts
                  ("ws_gate": [D, Fs], "ws_up": [D, Fs], "ws_down": [Fs, D],
                   "ws_score": [D]                               -- with a shared expert)
                 }  x L ],
     "final_norm": [D],
     ("lm_head": [D, V]  -- only with untied embeddings)}

Two layouts of the layers, the same weights:

    list     "layers": [ {name: array} x L ]  (what checkpoints load into; the unrolled layer loop)
    stacked  "layers": {name: [L, ...] array} (`stack_layers`; what `lax.scan` over the layers
             takes: `EngineConfig.layer_loop`, llmjax/model/llama.py)

The stacked layout's spec (`param_specs(config, stacked=True)`) gives each layer weight a leading
`layers` axis. `stack_layers` / `unstack_layers` convert (each is a no-op on its own layout),
`layer_params(params, i)` reads one layer in either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import ModelConfig
from llmjax.model.quant import is_packed

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight: its shape, the logical name of each axis, and how to initialize it."""

    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    init: str = "normal"  # "normal" (fan-in scaled) | "ones" | "zeros"
    fan_in: int = 1

    def __post_init__(self):
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"{self.shape=} and {self.logical_axes=} differ in rank")

    def initialize(self, key: jax.Array, dtype) -> jax.Array:
        if self.init == "ones":
            return jnp.ones(self.shape, dtype)
        if self.init == "zeros":
            return jnp.zeros(self.shape, dtype)
        scale = 1.0 / math.sqrt(self.fan_in)
        return (scale * jax.random.normal(key, self.shape, jnp.float32)).astype(dtype)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_specs(config: ModelConfig, stacked: bool = False) -> Params:
    """The spec tree of a Llama-family model (`stacked`: the layers' weights as one [L, ...]
    spec each, with a leading `layers` axis; see the module doc)."""
    D, V = config.hidden_size, config.vocab_size
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim

    # Gemma's norms scale by (1 + w): their neutral weight is 0, Llama's 1.
    norm_init = "zeros" if config.norm_plus_one else "ones"

    def layer() -> dict[str, ParamSpec]:
        spec = {
            "attn_norm": ParamSpec((D,), ("embed",), norm_init),
            "wq": ParamSpec((D, N, H), ("embed", "q_heads", "head_dim"), fan_in=D),
            "wk": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), fan_in=D),
            "wv": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), fan_in=D),
            "wo": ParamSpec((N, H, D), ("q_heads", "head_dim", "embed"), fan_in=N * H),
            "mlp_norm": ParamSpec((D,), ("embed",), norm_init),
            **_mlp_specs(config),
        }
        if config.qk_norm:
            spec["q_norm"] = ParamSpec((H,), ("head_dim",), norm_init)
            spec["k_norm"] = ParamSpec((H,), ("head_dim",), norm_init)
        if config.post_norms:
            spec["attn_post_norm"] = ParamSpec((D,), ("embed",), norm_init)
            spec["mlp_post_norm"] = ParamSpec((D,), ("embed",), norm_init)
        if config.attention_bias:
            spec["bq"] = ParamSpec((N, H), ("q_heads", "head_dim"), "zeros")
            spec["bk"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros")
            spec["bv"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros")
        return spec

    if stacked:
        L = config.num_layers
        layers = {
            name: dataclasses.replace(
                s, shape=(L, *s.shape), logical_axes=("layers", *s.logical_axes)
            )
            for name, s in layer().items()
        }
    else:
        layers = [layer() for _ in range(config.num_layers)]
    specs: Params = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), fan_in=1),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("embed",), norm_init),
    }
    if not config.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), fan_in=D)
    return specs


def _mlp_specs(config: ModelConfig) -> dict[str, ParamSpec]:
    """A layer's MLP: a dense gated MLP, or E experts stacked on a leading `experts` axis with
    their router [D, E] (replicated: every device routes every token) and, for Qwen2-MoE, a
    shared expert with its sigmoid gate's weight."""
    D = config.hidden_size
    if not config.is_moe:
        F = config.intermediate_size
        return {
            "w_gate": ParamSpec((D, F), ("embed", "mlp"), fan_in=D),
            "w_up": ParamSpec((D, F), ("embed", "mlp"), fan_in=D),
            "w_down": ParamSpec((F, D), ("mlp", "embed"), fan_in=F),
        }
    E, Fe = config.num_experts, config.expert_intermediate_size
    spec = {
        "router": ParamSpec((D, E), ("embed", "router"), fan_in=D),
        "we_gate": ParamSpec((E, D, Fe), ("experts", "embed", "expert_mlp"), fan_in=D),
        "we_up": ParamSpec((E, D, Fe), ("experts", "embed", "expert_mlp"), fan_in=D),
        "we_down": ParamSpec((E, Fe, D), ("experts", "expert_mlp", "embed"), fan_in=Fe),
    }
    Fs = config.shared_expert_intermediate_size
    if Fs:
        spec |= {
            "ws_gate": ParamSpec((D, Fs), ("embed", "mlp"), fan_in=D),
            "ws_up": ParamSpec((D, Fs), ("embed", "mlp"), fan_in=D),
            "ws_down": ParamSpec((Fs, D), ("mlp", "embed"), fan_in=Fs),
            "ws_score": ParamSpec((D,), ("embed",), fan_in=D),
        }
    return spec


def layers_stacked(params: Params) -> bool:
    """Whether `params` has the stacked layout (see the module doc)."""
    return isinstance(params["layers"], dict)


def stack_layers(params: Params) -> Params:
    """The list layout -> the stacked one ({name: [L, ...]}; numpy stays numpy, jax arrays are
    stacked on their device). The stacked layout is returned as it is."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params

    def stack(xs):
        if all(isinstance(x, np.ndarray) for x in xs):
            return np.stack(xs)
        return jnp.stack(xs)

    return {
        **params,
        "layers": {
            name: jax.tree.map(lambda *xs: stack(xs), *[layer[name] for layer in layers])
            for name in layers[0]
        },
    }


def unstack_layers(params: Params) -> Params:
    """The stacked layout -> the list one (each layer's weights sliced out: copies on a device).
    The list layout is returned as it is."""
    if not layers_stacked(params):
        return params
    L = next(iter(params["layers"].values())).shape[0]
    return {**params, "layers": [layer_params(params, i) for i in range(L)]}


def layer_params(params: Params, i: int) -> dict[str, Any]:
    """Layer i's weights {name: array}, in either layout."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return {name: x[i] for name, x in layers.items()}
    return layers[i]


def map_specs(fn: Callable[[ParamSpec], Any], specs: Params) -> Params:
    return jax.tree.map(fn, specs, is_leaf=_is_spec)


def abstract_params(config: ModelConfig, dtype=jnp.float32) -> Params:
    """`jax.ShapeDtypeStruct` for every weight, e.g. as an orbax restore target."""
    return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), param_specs(config))


def logical_axes(config: ModelConfig) -> Params:
    return map_specs(lambda s: s.logical_axes, param_specs(config))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random weights (for tests, notebooks and `load_format='dummy'`).

    Norm scales are drawn around 1 rather than set to 1 so that tests exercise them.
    """
    specs = param_specs(config)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys, strict=True):
        if spec.init == "ones":
            x = 1.0 + 0.1 * jax.random.normal(k, spec.shape, jnp.float32)
        elif spec.init == "zeros":
            x = 0.1 * jax.random.normal(k, spec.shape, jnp.float32)
        else:
            x = spec.initialize(k, jnp.float32)
        out.append(x.astype(dtype))
    return jax.tree.unflatten(treedef, out)


def check_params(config: ModelConfig, params: Params, source: str = "params") -> None:
    """Raise a ValueError naming the first weight whose presence or shape differs from the spec
    (of either layout)."""
    specs = param_specs(config, stacked=layers_stacked(params))
    flat_specs = dict(_flatten_with_names(specs))
    flat_params = dict(_flatten_with_names(params, is_leaf=is_packed))
    for name, spec in flat_specs.items():
        if name not in flat_params:
            raise ValueError(f"{source}: missing weight {name!r} (expected shape {spec.shape})")
        leaf = flat_params[name]
        shape = tuple(leaf.shape) if is_packed(leaf) else tuple(np.shape(leaf))
        if shape != spec.shape:
            raise ValueError(f"{source}: weight {name!r} has shape {shape}, expected {spec.shape}")
    extra = sorted(set(flat_params) - set(flat_specs))
    if extra:
        raise ValueError(f"{source}: unexpected weights {extra[:5]} for this model config")


def _flatten_with_names(tree, is_leaf=_is_spec) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(jax.tree_util.keystr(path, simple=True, separator="."), leaf) for path, leaf in flat]


def num_params(config: ModelConfig) -> int:
    specs = jax.tree.leaves(param_specs(config), is_leaf=_is_spec)
    return sum(math.prod(s.shape) for s in specs)
