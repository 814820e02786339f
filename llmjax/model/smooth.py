"""SmoothQuant (Xiao et al., ICML 2023): move activation outliers into the weights before W8A8.

W8A8 quantizes activations per token at run time (llmjax/model/quant.py): a few input channels
of a matmul carry most of an activation row's magnitude (outlier channels, up to 100x the rest),
so one int8 scale per token rounds the other channels to a handful of levels. SmoothQuant divides
each input channel j of X by a factor s_j and multiplies row j of the weight by it, which leaves
X @ W unchanged:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(max|X_j| over calibration tokens, max|W_j| over the matrix's row j, taken over every matrix
that reads X; `alpha`, the migration strength, is 0.5 in the paper for most models). The
division by s is folded into whatever produced X, so nothing is added at run time:

    attention input  -> attn_norm's scale (wq, wk, wv read it)          [the paper's Llama recipe]
    MLP input        -> mlp_norm's scale (w_gate, w_up read it)         [the paper's Llama recipe]
    w_down's input   -> w_up's output columns (silu(gate) * up is linear in up)      ['all']
    wo's input       -> wv's output columns (attention is linear in V); query heads that
                        share a kv head share its factors (the max over the group)   ['all']

`collect_input_absmax` measures max|X_j| with one prefill of calibration tokens through the
model's own forward (reference attention), recording every matmul's input; `smooth_params`
rescales a float parameter tree; `smoothquant` does both. The result is the same float model
(equal up to rounding: tests/test_smoothquant.py), easier to quantize per token.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np

from llmjax.config import ModelConfig

DEFAULT_ALPHA = 0.5  # the paper's migration strength for most models; LLM(smoothquant='auto')
CALIBRATION_TOKENS = 512  # tokens of the bundled text's tail the statistics come from
SCOPES = ("norms", "all")  # which inputs are smoothed: the paper's two, or all four (see above)
INPUTS = ("attn", "o", "mlp", "down")  # recorded inputs per layer: [D], [N*H], [D], [F]
_READERS = {  # each matrix -> the input it reads
    "wq": "attn",
    "wk": "attn",
    "wv": "attn",
    "wo": "o",
    "w_gate": "mlp",
    "w_up": "mlp",
    "w_down": "down",
}


def check_alpha(alpha: float) -> float:
    """The migration strength as a float, or ValueError outside [0, 1]."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant's migration strength must be in [0, 1], got {alpha}")
    return alpha


@contextlib.contextmanager
def _recording_linear(record):
    """Every `linear(x, w)` of the model's projections (llama.py's and layers.py's MLP, all
    through llmjax/model/lora.py's `project`) also calls record(x, w) while this is active (at
    trace time: record keeps traced values)."""
    from llmjax.model import lora, quant

    real = quant.linear

    def recording(x, w):
        record(x, w)
        return real(x, w)

    lora.linear = recording
    try:
        yield
    finally:
        lora.linear = real


def collect_input_absmax(params, config: ModelConfig, token_ids, page_size: int = 16):
    """One prefill of `token_ids` through the model's own layers (`decoder_layer`, reference
    attention; one layer jitted, run for each layer in turn: one compile per attention kind,
    whatever the depth)
    -> per layer {'attn': [D], 'o': [N*H], 'mlp': [D], 'down': [F]}: each matmul input's largest
    magnitude per channel over the tokens (float32 numpy)."""
    import jax
    import jax.numpy as jnp

    from llmjax.model.attention import reference_attention
    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.layers import rope_cos_sin
    from llmjax.model.llama import decoder_layer, embed_tokens
    from llmjax.model.params import unstack_layers
    from llmjax.model.step_input import contiguous_prefill

    params = unstack_layers(params)
    n = len(token_ids)
    if n < 1:
        raise ValueError("calibration needs at least one token")
    step, _ = contiguous_prefill([list(token_ids)], n, page_size)

    @functools.partial(jax.jit, static_argnames="kind")
    def one_layer(layer, x, kv, step, cos, sin, kind):
        names = {id(layer[name]): what for name, what in _READERS.items()}
        stats = {}

        def record(x, w):
            what = names.get(id(w))
            if what is not None:
                x = jnp.abs(x.reshape(x.shape[0], -1).astype(jnp.float32))
                stats[what] = jnp.max(x, axis=0)

        with _recording_linear(record):
            x, _ = decoder_layer(layer, x, kv, step, cos, sin, config, reference_attention, kind)
        return x, stats

    dtype = params["final_norm"].dtype
    kv = allocate_kv_pages(config, -(-n // page_size) + 1, page_size, dtype)[0]
    x = embed_tokens(params, step.token_ids, config)
    cos, sin = rope_cos_sin(step.positions, config)
    out = []
    for i, layer in enumerate(params["layers"]):
        x, stats = one_layer(layer, x, kv, step, cos, sin, config.layer_kind_ids[i])
        missing = [w for w in INPUTS if w not in stats]
        if missing:
            raise ValueError(f"calibration did not see layer {i}'s matmul inputs {missing}")
        out.append({k: np.asarray(v) for k, v in stats.items()})
    return out


def calibration_tokens(tokenizer, vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The last `n` tokens of the bundled public-domain text (llmjax/data/alice.txt): its
    end, so that scripts/eval_precision.py's perplexity windows and prompts (its beginning) are
    never what the scales were calibrated on. Without a tokenizer (random weights) its bytes
    folded into the vocabulary."""
    from llmjax.data.texts import text_token_ids

    ids = text_token_ids(tokenizer, vocab_size)
    if len(ids) < n:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {n=}")
    return ids[-n:]


def _factors(x_absmax, w_absmax, alpha: float) -> np.ndarray:
    """s = max|X|^alpha / max|W|^(1-alpha), per channel; channels never active (or with an
    all-zero weight row) keep s = 1."""
    x = np.asarray(x_absmax, np.float64)
    w = np.asarray(w_absmax, np.float64)
    ok = (x > 0) & (w > 0)
    s = np.ones_like(x)
    s[ok] = x[ok] ** alpha / w[ok] ** (1.0 - alpha)
    return np.clip(s, 1e-5, 1e5)


def _rows_absmax(*ws, in_ndim: int = 1) -> np.ndarray:
    """max |w| over each input channel (the leading `in_ndim` axes, flattened) of every matrix."""
    mats = [
        np.abs(np.asarray(w, np.float32)).reshape(int(np.prod(w.shape[:in_ndim])), -1) for w in ws
    ]
    return np.max(np.concatenate(mats, axis=1), axis=1)


def smooth_params(params, stats, config: ModelConfig, alpha: float = 0.5, scope: str = "all"):
    """A copy of the (list-layout, float) parameter tree with the inputs of `scope` smoothed by
    migration strength `alpha` (see the module doc); `stats` from `collect_input_absmax`."""
    alpha = check_alpha(alpha)
    if scope not in SCOPES:
        raise ValueError(f"unknown smoothing {scope=}; choose one of {SCOPES}")
    if isinstance(params["layers"], dict):
        raise ValueError("smooth_params takes the list layout (stack the layers afterwards)")
    if len(stats) != len(params["layers"]):
        raise ValueError(f"{len(stats)} layers of statistics for {len(params['layers'])} layers")
    K, H = config.num_kv_heads, config.head_dim
    group = config.num_heads // K
    out = dict(params)
    layers = []
    for layer, st in zip(params["layers"], stats, strict=True):
        layer = {k: np.asarray(v) for k, v in layer.items()}
        f32 = {k: v.astype(np.float32) for k, v in layer.items()}
        new = dict(layer)
        # attention input: attn_norm / s, rows of wq, wk, wv * s
        s = _factors(st["attn"], _rows_absmax(f32["wq"], f32["wk"], f32["wv"]), alpha)
        new["attn_norm"] = f32["attn_norm"] / s
        for k in ("wq", "wk", "wv"):
            new[k] = f32[k] * s.reshape(-1, 1, 1)
        # MLP input: mlp_norm / s, rows of w_gate, w_up * s
        s = _factors(st["mlp"], _rows_absmax(f32["w_gate"], f32["w_up"]), alpha)
        new["mlp_norm"] = f32["mlp_norm"] / s
        new["w_gate"] = f32["w_gate"] * s[:, None]
        new["w_up"] = f32["w_up"] * s[:, None]
        if scope == "all":
            # w_down's input (silu(gate) * up): w_up's columns / s, w_down's rows * s
            s = _factors(st["down"], _rows_absmax(f32["w_down"]), alpha)
            new["w_up"] = new["w_up"] / s[None, :]
            new["w_down"] = f32["w_down"] * s[:, None]
            # wo's input, [N, H] channels: one factor per (kv head, h), the max over its group
            x = np.asarray(st["o"]).reshape(K, group, H).max(axis=1)
            w = _rows_absmax(f32["wo"], in_ndim=2).reshape(K, group, H).max(axis=1)
            s = _factors(x, w, alpha)  # [K, H]
            new["wv"] = new["wv"] / s[None]
            if "bv" in layer:
                new["bv"] = f32["bv"] / s
            new["wo"] = f32["wo"] * np.repeat(s, group, axis=0)[:, :, None]
        for k in new:  # back to each array's own dtype
            if new[k] is not layer[k]:
                new[k] = new[k].astype(layer[k].dtype)
        layers.append(new)
    out["layers"] = layers
    return out


def smoothquant(params, config: ModelConfig, token_ids, alpha: float = 0.5, scope: str = "all"):
    """`smooth_params` with statistics from one prefill of `token_ids` (`collect_input_absmax`)."""
    return smooth_params(
        params, collect_input_absmax(params, config, token_ids), config, alpha, scope
    )


def describe(stats) -> dict[str, Any]:
    """How uneven each input is (max over channels / median over channels of max|X_j|), the
    median over layers: the outliers SmoothQuant targets."""
    return {
        what: float(np.median([np.max(s[what]) / max(np.median(s[what]), 1e-12) for s in stats]))
        for what in INPUTS
    }
