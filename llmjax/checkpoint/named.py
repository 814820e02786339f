"""Weights from a trainer (`LLM.update_weights`): a pytree in llmjax's layout, or named arrays
(llmjax's flat names or HF's checkpoint names) -> the model's parameter tree (the list layout,
llmjax/model/params.py), each array kept where it is (a jax array stays on its devices: the HF
conversions are transposes and reshapes, which jax runs there).

    llmjax names   embed, final_norm, lm_head, layers.{i}.{wq, wk, ..., attn_norm, ...}
    HF names       model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...
                   (`hf_layer_table`: the same map the HF loader and exporter use)

A name may come once; a name the model does not have, a missing weight or a shape the model
does not take raises ValueError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from llmjax.checkpoint.hf import hf_layer_table
from llmjax.config import ModelConfig
from llmjax.model.params import Params, check_params, layers_stacked, unstack_layers

SOURCE_FORMATS = ("llmjax", "hf")


def _stack(xs):
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs)
    import jax.numpy as jnp

    return jnp.stack(xs)


def named_arrays(weights) -> dict[str, object]:
    """A mapping or an iterable of (name, array) pairs -> {name: array}; a name twice raises."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    out: dict[str, object] = {}
    for name, x in items:
        if name in out:
            raise ValueError(f"update_weights: weight {name!r} given twice")
        out[name] = x
    return out


def params_from_llmjax_names(config: ModelConfig, named: Mapping[str, object]) -> Params:
    """{'embed': ..., 'layers.3.wq': ...} -> the list-layout tree."""
    layers: list[dict] = [{} for _ in range(config.num_layers)]
    params: dict = {"layers": layers}
    for name, x in named.items():
        m = re.fullmatch(r"layers\.(\d+)\.(\w+)", name)
        if m is None:
            if "." in name:
                raise ValueError(f"update_weights: unexpected weight {name!r} for this model")
            params[name] = x
            continue
        i = int(m.group(1))
        if i >= config.num_layers:
            raise ValueError(
                f"update_weights: weight {name!r}: the model has {config.num_layers} layers"
            )
        layers[i][m.group(2)] = x
    return params


def params_from_hf_names(config: ModelConfig, named: Mapping[str, object]) -> Params:
    """HF checkpoint names -> the list-layout tree (`hf_layer_table`'s conversions)."""
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]):
        if name not in named:
            raise ValueError(f"update_weights: missing HF weight {name!r} (shape {shape})")
        x = named[name]
        if tuple(x.shape) != tuple(shape):
            raise ValueError(
                f"update_weights: HF weight {name!r} has shape {tuple(x.shape)}, the model "
                f"takes {tuple(shape)}"
            )
        used.add(name)
        return x

    D, V = config.hidden_size, config.vocab_size
    table = hf_layer_table(config)

    def layer(i: int) -> dict:
        out = {}
        for ours, (hf, shape, to_ours, _) in table.items():
            name = f"model.layers.{i}.{hf}"
            if "{e}" in hf:
                experts = range(config.num_experts)
                out[ours] = _stack([to_ours(take(name.format(e=e), shape)) for e in experts])
            else:
                out[ours] = to_ours(take(name, shape))
        return out

    params: dict = {
        "embed": take("model.embed_tokens.weight", (V, D)),
        "layers": [layer(i) for i in range(config.num_layers)],
        "final_norm": take("model.norm.weight", (D,)),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = take("lm_head.weight", (V, D)).T
    extra = sorted(set(named) - used)
    if extra:
        raise ValueError(f"update_weights: unexpected HF weights {extra[:5]} for this model")
    return params


def params_from_source(config: ModelConfig, weights, source_format: str = "llmjax") -> Params:
    """`weights` (a llmjax pytree with 'layers' in either layout, or named arrays: a mapping or
    an iterable of (name, array) pairs, llmjax's or HF's names) -> the list-layout tree,
    checked against `config` (every weight present once, with its shape)."""
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"{source_format=}: choose one of {SOURCE_FORMATS}")
    if source_format == "llmjax" and isinstance(weights, Mapping) and "layers" in weights:
        params = dict(weights)
        params = unstack_layers(params) if layers_stacked(params) else params
    elif source_format == "llmjax":
        params = params_from_llmjax_names(config, named_arrays(weights))
    else:
        params = params_from_hf_names(config, named_arrays(weights))
    check_params(config, params, "update_weights")
    return params
