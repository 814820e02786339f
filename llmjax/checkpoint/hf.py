"""HF checkpoints: `config.json` + `*.safetensors` (one file or shards with an index).

`params_from_hf_tensors` is the one place that maps HF's Llama tensor names and layouts to ours; the
GGUF loader renames its tensors to HF names and reuses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from llmjax.config import ModelConfig
from llmjax.model.params import Params, check_params

GetTensor = Callable[[str], np.ndarray]  # HF tensor name -> array in HF layout ([out, in])


def params_from_hf_tensors(
    config: ModelConfig, get: GetTensor, source: str, dtype=np.float32, lazy: bool = False
) -> Params:
    """Build our parameter tree from tensors named and laid out as in HF's LlamaForCausalLM.

    `lazy=True` returns the tree with a thunk at every leaf (a function that reads and converts
    that one weight), for loading shard by shard: `llmjax.parallel.mesh.place_params` calls each
    thunk only when it places that weight, so the host holds one weight at a time."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        x = get(name)
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(x.shape)}, expected {shape} for "
                f"this model config"
            )
        return np.asarray(x).astype(dtype)

    def weight(name: str, shape: tuple[int, ...], convert=lambda x: x):
        def load() -> np.ndarray:
            return np.ascontiguousarray(convert(take(name, shape)))

        return load

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        out = {
            "attn_norm": weight(p + "input_layernorm.weight", (D,)),
            "wq": weight(p + "self_attn.q_proj.weight", (N * H, D), lambda x: x.T.reshape(D, N, H)),
            "wk": weight(p + "self_attn.k_proj.weight", (K * H, D), lambda x: x.T.reshape(D, K, H)),
            "wv": weight(p + "self_attn.v_proj.weight", (K * H, D), lambda x: x.T.reshape(D, K, H)),
            "wo": weight(p + "self_attn.o_proj.weight", (D, N * H), lambda x: x.T.reshape(N, H, D)),
            "mlp_norm": weight(p + "post_attention_layernorm.weight", (D,)),
            "w_gate": weight(p + "mlp.gate_proj.weight", (F, D), lambda x: x.T),
            "w_up": weight(p + "mlp.up_proj.weight", (F, D), lambda x: x.T),
            "w_down": weight(p + "mlp.down_proj.weight", (D, F), lambda x: x.T),
        }
        if config.attention_bias:
            out["bq"] = weight(p + "self_attn.q_proj.bias", (N * H,), lambda x: x.reshape(N, H))
            out["bk"] = weight(p + "self_attn.k_proj.bias", (K * H,), lambda x: x.reshape(K, H))
            out["bv"] = weight(p + "self_attn.v_proj.bias", (K * H,), lambda x: x.reshape(K, H))
        return out

    params: Params = {
        "embed": weight("model.embed_tokens.weight", (V, D)),
        "layers": [layer(i) for i in range(config.num_layers)],
        "final_norm": weight("model.norm.weight", (D,)),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = weight("lm_head.weight", (V, D), lambda x: x.T)
    if lazy:
        return params
    params = _load_all(params)
    check_params(config, params, source)
    return params


def _load_all(tree):
    """Call every thunk, in the tree's own order (the model's: errors name the first bad weight)."""
    if isinstance(tree, dict):
        return {k: _load_all(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_load_all(v) for v in tree]
    return tree()


def safetensors_files(directory: str) -> list[str]:
    """The safetensors files of an HF directory, via the shard index when there is one."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({os.path.join(directory, name) for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from e
        for path in files:
            if not os.path.exists(path):
                raise FileNotFoundError(f"shard {path} listed in {index} is missing")
        return files
    files = sorted(
        os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors")
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return files


def load_hf(directory: str, dtype=np.float32, lazy: bool = False) -> tuple[ModelConfig, Params]:
    """Load an HF model directory -> (ModelConfig, numpy parameter tree in `dtype`; with `lazy`,
    a thunk per weight that reads it when called: see `params_from_hf_tensors`)."""
    from safetensors import SafetensorError, safe_open

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"HF checkpoint directory not found: {directory}")
    config = ModelConfig.from_hf_config(directory)
    handles, where = [], {}
    try:
        for path in safetensors_files(directory):
            try:
                handle = safe_open(path, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path} is not a readable safetensors file: {e}") from e
            handles.append(handle)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                where[name] = (path, handle)

        def get(name: str) -> np.ndarray:
            if name not in where:
                raise ValueError(f"{directory}: tensor {name!r} not found in any safetensors file")
            path, handle = where[name]
            try:
                return handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"{path}: cannot read tensor {name!r}: {e}") from e

        params = params_from_hf_tensors(config, get, directory, dtype, lazy)
    finally:
        if not lazy:  # lazy thunks keep the (memory-mapped) files open until they are dropped
            handles.clear()
    return config, params
