"""The weights an `LLM` serves (llmjax/llm.py): read, smoothed, packed and placed. Nothing here
imports llm.py; `LLM.__init__` calls `load_weights` (a real device) or `sim_model` (device='sim').

    load_weights       the steps below in order, as `LLM(...)` runs them at load
    load               a preset's random weights, a GGUF file, an HF or orbax directory ->
                       (ModelConfig, params, Tokenizer | None)
    smoothquant_alpha  `LLM(smoothquant=)` -> SmoothQuant's migration strength, or None
    smoothed           SmoothQuant of int8's float weights (llmjax/model/smooth.py)
    pack_weights       packed for a quantization (llmjax/model/quant.py)
    to_device          each weight a jax array in the LLM's dtype
    sim_model          a simulated device's model: its shape and tokenizer, no weights, no JAX
    infinigen_skew     InfiniGen's skewing matrices, read or calibrated (llmjax/sparse/skew.py)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np

from llmjax.config import (
    QUANTIZATIONS,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    layer_loop_scans,
)
from llmjax.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def load_weights(
    model: str,
    dtype: str,
    quantization: str,
    smoothquant,
    tokenizer: str | None,
    load_format: str,
    parallel: ParallelConfig,
    layer_loop: str,
    sparse_kv,
):
    """`LLM.__init__`'s weights, `quantization` checked first: -> (ModelConfig, params,
    Tokenizer | None, SmoothQuant's alpha or None). With tp * pp > 1 (`parallel`) the weights
    stay as loaded (ModelRunner places them); else packed for `quantization`, stacked by layer
    when the engine scans over them, and on the device."""
    sharded = (
        parallel.tp * parallel.pp > 1
    )  # then weights load one at a time, each device its shard
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown {quantization=}; choose one of {QUANTIZATIONS}")
    if quantization != "none" and sharded:
        raise ValueError(
            f"quantization={quantization!r} runs on one device for now "
            f"(tp={parallel.tp}, pp={parallel.pp})"
        )
    alpha = smoothquant_alpha(smoothquant, quantization)  # checked before the load
    model_config, params, tok = load(
        model, dtype, load_format, tokenizer, parallel if sharded else None, quantization
    )
    if alpha is not None and model_config.is_moe:
        if smoothquant != "auto":
            raise ValueError(
                f"smoothquant={smoothquant!r}: SmoothQuant of a mixture of experts (its "
                "router and experts share the MLP input) is not implemented; use "
                "smoothquant='none'"
            )
        logger.info("SmoothQuant skipped: not implemented for a mixture of experts")
        alpha = None
    params = prepare_weights(
        params, model_config, dtype, quantization, alpha, tok, parallel, layer_loop, sparse_kv
    )
    return model_config, params, tok, alpha


def prepare_weights(
    params, model_config, dtype, quantization, alpha, tok, parallel, layer_loop, sparse_kv
):
    """Loaded weights (the list layout) as the engine takes them: smoothed (SmoothQuant's
    `alpha`, calibrated on the bundled text), then with one device packed for `quantization`,
    stacked by layer when the engine scans over them, and on the device in `dtype`; with
    tp * pp > 1 as they are (ModelRunner places them). The path of `load_weights` and of
    `LLM.update_weights`, so updated weights run exactly as loaded ones would."""
    if alpha is not None:
        params = smoothed(params, model_config, tok, alpha)
    if parallel.tp * parallel.pp > 1:  # ModelRunner places (and converts) each weight
        return params
    params = pack_weights(params, quantization, dtype)
    sparse = sparse_kv if isinstance(sparse_kv, str) else sparse_kv.mode
    if layer_loop_scans(layer_loop, sparse != "none"):
        from llmjax.model.params import stack_layers

        params = stack_layers(params)  # on the host, before the device holds them
    return to_device(params, dtype)


def sim_model(model: str, dtype: str, quantization: str, tokenizer, tp, pp, ep, sim):
    """device='sim': the model's shape only (a preset, an HF directory's config.json or a GGUF
    file's metadata), no weights and no JAX; the tokenizer from `tokenizer` or the model's own
    file (a preset's: pass tokenizer=). -> (ModelConfig, Tokenizer | None, what the LLM fixed)."""
    import configs
    from llmjax.sim.runner import SimConfig

    if quantization != "none":
        raise ValueError(f"the simulated device models no quantization ({quantization=})")
    if model in configs.PRESETS:
        model_config, source = configs.get_preset(model), tokenizer
    elif os.path.isdir(model):
        model_config, source = ModelConfig.from_hf_config(model), tokenizer or model
    elif model.endswith(".gguf") and os.path.isfile(model):
        from llmjax.checkpoint.gguf import model_config_from_gguf

        model_config, source = model_config_from_gguf(model), tokenizer or model
    else:
        raise ValueError(
            f"model {model!r} is not a preset ({sorted(configs.PRESETS)}), an HF directory "
            "or a .gguf file"
        )
    tok = None
    if source is not None:
        if source.endswith(".gguf"):
            tok = Tokenizer.from_gguf(source)
        elif os.path.exists(os.path.join(source, "tokenizer.json")):
            tok = Tokenizer.from_hf_dir(source)
    fixed = dict(
        model=model,
        dtype=dtype,
        quantization="none",
        tp=tp,
        pp=pp,
        ep=ep,
        pad_heads=False,
        device="sim",
        sim=sim if sim is not None else SimConfig(),
    )
    return model_config, tok, fixed


def infinigen_skew(config: EngineConfig, params, tokenizer, num_tokens: int):
    """InfiniGen's skew for `config.model`: read from `sparse_kv.skew_dir` if it holds one, else
    calibrated on the bundled text (and written there when a skew_dir is given)."""
    from llmjax.model.params import unstack_layers
    from llmjax.sparse.skew import SKEW_FILE, calibrate_on_text, load_skew, save_skew

    params = unstack_layers(params)

    skew_dir = config.sparse_kv.skew_dir
    if skew_dir and os.path.exists(os.path.join(skew_dir, SKEW_FILE)):
        return load_skew(skew_dir, config.model)
    t = time.perf_counter()
    n = min(num_tokens, config.max_model_len)
    skew = calibrate_on_text(params, config.model, tokenizer, n)
    logger.info("InfiniGen skew calibrated on %d tokens in %.1f s", n, time.perf_counter() - t)
    if skew_dir:
        logger.info("wrote %s", save_skew(skew_dir, *skew, n))
    return skew


def smoothquant_alpha(smoothquant, quantization: str) -> float | None:
    """LLM's `smoothquant` -> SmoothQuant's migration strength, or None (not smoothed)."""
    from llmjax.model.smooth import DEFAULT_ALPHA, check_alpha

    if smoothquant == "auto":
        return DEFAULT_ALPHA if quantization == "w8a8" else None
    if smoothquant is None or smoothquant == "none":
        return None
    try:
        alpha = float(smoothquant)
    except (TypeError, ValueError):
        raise ValueError(
            f"{smoothquant=} must be 'auto', None / 'none' or a migration strength in [0, 1]"
        ) from None
    if quantization != "w8a8":
        raise ValueError(
            f"smoothquant={smoothquant!r} smooths activations for W8A8 (quantization='w8a8'), "
            f"not for quantization={quantization!r}"
        )
    return check_alpha(alpha)


def smoothed(params, model_config, tokenizer, alpha: float):
    """SmoothQuant (llmjax/model/smooth.py) of the loaded float weights: activation statistics
    from one prefill of the tail of the bundled text, then every layer's inputs smoothed."""
    from llmjax.model import smooth

    t = time.perf_counter()
    ids = smooth.calibration_tokens(tokenizer, model_config.vocab_size)
    params = smooth.smoothquant(params, model_config, ids, alpha)
    logger.info(
        "SmoothQuant (alpha %g) calibrated on %d tokens in %.1f s",
        alpha,
        len(ids),
        time.perf_counter() - t,
    )
    return params


def pack_weights(params, quantization: str, dtype: str):
    """The loaded (list-layout, host) weights packed for `quantization` (llmjax/model/quant.py):
    'int8', 'w8a8', 'int8_wo', 'q8_0', 'q4_0', 'q4_1' quantize every matrix; 'gguf' came packed
    from the loader.
    Unquantized weights on a CPU are packed [out, in] ('dense'): the C++ dense kernel
    (kernels_cpu/dense_matmul.py) takes them at decode-sized steps, and XLA:CPU's bf16 and f16
    dots run on their fast kernels only with both operands contracting their last dim."""
    import jax

    from llmjax.model.quant import quantize_params

    if quantization == "none":
        if jax.default_backend() == "cpu":
            return quantize_params(params, "dense")
        return params
    if quantization == "gguf":
        return params
    return quantize_params(params, quantization)


def to_device(params, dtype: str):
    """Each weight as a jax array in `dtype` (a packed weight's dense values too; quantized
    values and their scales keep their own dtypes)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from llmjax.model.quant import is_packed

    def one(x):
        if not is_packed(x):
            return jnp.asarray(x, dtype)
        values = jnp.asarray(x.values, dtype if x.fmt == "dense" else None)
        return dataclasses.replace(
            x,
            values=values,
            **{k: jax.tree.map(jnp.asarray, getattr(x, k)) for k in ("scales", "mins")},
        )

    return jax.tree.map(one, params, is_leaf=is_packed)


def load(
    model: str,
    dtype: str,
    load_format: str,
    tokenizer_path: str | None,
    parallel: ParallelConfig | None = None,
    quantization: str = "none",
):
    """-> (ModelConfig, params, Tokenizer | None). With `parallel` (a sharded run), GGUF/HF
    weights come as thunks that load one weight each (see `params_from_hf_tensors`) and orbax
    restores each device's shards directly; ModelRunner then places them on the mesh."""
    import jax

    import configs
    from llmjax.checkpoint import PRESET_WEIGHTS, load_gguf, load_model, resolve_model_path
    from llmjax.checkpoint.gguf import open_gguf
    from llmjax.model.params import init_params

    if load_format == "dummy":
        if quantization == "gguf":
            raise ValueError("quantization='gguf' keeps a GGUF file's blocks: not with 'dummy'")
        config = configs.get_preset(model)
        params = init_params(config, jax.random.key(0), dtype)
        if tokenizer_path is None and model in PRESET_WEIGHTS:
            # Random weights, but the preset's real tokenizer when its file is at hand.
            with contextlib.suppress(FileNotFoundError):
                tokenizer_path = resolve_model_path(model)
        tok = Tokenizer.from_gguf(tokenizer_path) if tokenizer_path else None
        return config, params, tok
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else np.float32
    path = resolve_model_path(model)
    if path.endswith(".gguf") and os.path.isfile(path):
        reader = open_gguf(path)  # read once for both weights and tokenizer
        config, params = load_gguf(
            reader, np_dtype, lazy=parallel is not None, quantized=quantization == "gguf"
        )
        kind, path = "gguf", reader
    elif quantization == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf checkpoint; {model!r} is not one")
    else:
        config, params, kind = load_model(model, np_dtype, parallel=parallel)
    source = tokenizer_path or path
    if not isinstance(source, str) or source.endswith(".gguf"):
        tok = Tokenizer.from_gguf(source)
    elif os.path.exists(os.path.join(source, "tokenizer.json")):
        tok = Tokenizer.from_hf_dir(source)
    else:
        logger.warning("no tokenizer found for %s (%s); pass tokenizer=... for text", model, kind)
        tok = None
    return config, params, tok
