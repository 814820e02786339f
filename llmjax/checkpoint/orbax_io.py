"""Save and restore our own converted parameters with orbax.

Layout of a saved directory:
    <dir>/llmjax_model_config.json   the ModelConfig (so the directory is self-describing)
    <dir>/params/                    orbax StandardCheckpointer item (our parameter tree)

Restoring converts nothing: it is the fast path after a one-time GGUF or HF conversion
(`scripts/convert_checkpoint.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from llmjax.config import ModelConfig, ParallelConfig, RopeScaling
from llmjax.model.params import Params, abstract_params, check_params, unstack_layers

CONFIG_FILE = "llmjax_model_config.json"


def is_orbax_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def save_params(directory: str, config: ModelConfig, params: Params) -> None:
    """Save `params` (either layer layout, llmjax/model/params.py; stored as the list layout,
    plain: packed weights, llmjax/model/quant.py, are stored dequantized to float32)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from llmjax.model.quant import unpack_params

    directory = os.path.abspath(os.fspath(directory))
    check_params(config, params, "save_params")
    params = unpack_params(unstack_layers(params), jnp.float32)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(config), f, indent=2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(directory, "params"), params, force=True)


def load_model_config(directory: str) -> ModelConfig:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"not an llmjax checkpoint: {path} is missing")
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return ModelConfig(**d)
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a valid llmjax model config: {e}") from e


def restore_params(
    directory: str, dtype=np.float32, parallel: ParallelConfig | None = None
) -> tuple[ModelConfig, Params]:
    """Restore (ModelConfig, parameter tree of jax arrays in `dtype`). With `parallel`, every
    weight is restored into its shards on that mesh (the rules table applied to the stored
    layout; orbax reads each device's slice only)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    config = load_model_config(directory)
    item = os.path.join(directory, "params")
    if not os.path.isdir(item):
        raise FileNotFoundError(f"llmjax checkpoint {directory} lacks its params/ item")
    target = abstract_params(config, dtype)
    if parallel is not None and parallel.num_devices > 1:
        from llmjax.parallel.mesh import make_mesh, param_shardings

        shardings = param_shardings(config, make_mesh(parallel))
        target = jax.tree.map(
            lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s), target, shardings
        )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(item, target)
    except Exception as e:
        raise ValueError(f"cannot restore parameters from {item}: {e}") from e
    check_params(config, params, item)
    return config, jax.tree.map(lambda x: x, params)
