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
    config: ModelConfig, get: GetTensor, source: str, dtype=np.float32
) -> Params:
    """Build our parameter tree from tensors named and laid out as in HF's LlamaForCausalLM."""
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

    def layer(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}."
        out = {
            "attn_norm": take(p + "input_layernorm.weight", (D,)),
            "wq": take(p + "self_attn.q_proj.weight", (N * H, D)).T.reshape(D, N, H),
            "wk": take(p + "self_attn.k_proj.weight", (K * H, D)).T.reshape(D, K, H),
            "wv": take(p + "self_attn.v_proj.weight", (K * H, D)).T.reshape(D, K, H),
            "wo": take(p + "self_attn.o_proj.weight", (D, N * H)).T.reshape(N, H, D),
            "mlp_norm": take(p + "post_attention_layernorm.weight", (D,)),
            "w_gate": take(p + "mlp.gate_proj.weight", (F, D)).T,
            "w_up": take(p + "mlp.up_proj.weight", (F, D)).T,
            "w_down": take(p + "mlp.down_proj.weight", (D, F)).T,
        }
        if config.attention_bias:
            out["bq"] = take(p + "self_attn.q_proj.bias", (N * H,)).reshape(N, H)
            out["bk"] = take(p + "self_attn.k_proj.bias", (K * H,)).reshape(K, H)
            out["bv"] = take(p + "self_attn.v_proj.bias", (K * H,)).reshape(K, H)
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    params: Params = {
        "embed": take("model.embed_tokens.weight", (V, D)),
        "layers": [layer(i) for i in range(config.num_layers)],
        "final_norm": take("model.norm.weight", (D,)),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(take("lm_head.weight", (V, D)).T)
    check_params(config, params, source)
    return params


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


def load_hf(directory: str, dtype=np.float32) -> tuple[ModelConfig, Params]:
    """Load an HF model directory -> (ModelConfig, numpy parameter tree in `dtype`)."""
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

        params = params_from_hf_tensors(config, get, directory, dtype)
    finally:
        handles.clear()
    return config, params
