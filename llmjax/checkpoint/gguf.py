"""GGUF checkpoints (llama.cpp): metadata -> ModelConfig, tensors dequantized to HF layout.

llama.cpp's converter permutes the rows of Q and K so that rotary pairs are adjacent (GPT-J style
interleaving); our model, like HF, rotates the two halves of each head. `unpermute_rope_rows`
undoes it: per head, rows are stored as [pair0.a, pair0.b, pair1.a, ...] and HF wants
[pair0.a, pair1.a, ..., pair0.b, pair1.b, ...].

Only the `llama` architecture's files are permuted (llama.cpp rotates them GPT-J style); Qwen2,
Qwen3 and Gemma use NEOX rotation, which is HF's, and are stored as HF has them.

Llama 3.1+ files carry no llama3 rope parameters but a `rope_freqs` tensor: llama.cpp's divisor
per rotary frequency, computed from them. It becomes `RopeScaling(rope_type="freq_factors")`.

Gemma (`gemma2`, `gemma3`): llama.cpp's converter stores every norm weight as 1 + w (Gemma's
RMSNorm scales by 1 + w; llama.cpp's by the weight): the loader subtracts the 1. The score scale
is `{arch}.attention.scale` where the file has it, else llama.cpp's rule (query_pre_attn_scalar
= hidden_size / num_heads for the 27B shapes, head_dim otherwise); the sliding layers follow
`{arch}.attention.sliding_window_pattern` (every n-th layer global, or a per-layer flag), else
llama.cpp's fixed patterns (every 2nd for Gemma 2, every 6th for Gemma 3), and Gemma 3's local
RoPE base is `{arch}.rope.freq_base_swa`, else 10000.

Mixtures of experts (a `llama` file with `llama.expert_count`: Mixtral; `qwen2moe`, `qwen3moe`):
`{arch}.expert_count` / `expert_used_count` / `expert_feed_forward_length` /
`expert_shared_feed_forward_length`; the experts of a layer are one stacked tensor per projection
(`ffn_gate_exps` [E, Fe, D], ...), read into our stacked layout. With quantization='gguf' a stacked
expert tensor of a kept block type stays packed too, expert by expert (one PackedWeight with an
experts axis: llmjax/model/quant.py's EXPERT_MATRICES, multiplied by llmjax/model/grouped_qdot.py).
"""

from __future__ import annotations

import os
import re

import numpy as np

from llmjax.checkpoint.gguf_file import gguf_file_name, open_gguf  # also imported from here
from llmjax.config import FAMILY_TRAITS, ModelConfig, RopeScaling
from llmjax.model.params import Params

GGUF_ARCHITECTURES = {
    "llama": "llama",  # Mixtral too: a llama file with {arch}.expert_count
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}
# Whether the top-k routing weights are renormalized, as llama.cpp's graphs do (a file's
# {arch}.expert_weights_norm, where it has one, decides).
_MOE_NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
_GEMMA = ("gemma2", "gemma3")
# llama.cpp's defaults for Gemma files without the keys: the global-layer period, soft caps,
# the 27B shapes' layer counts (their scores are scaled by hidden_size / num_heads).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# GGUF tensor name (per block: blk.{i}.X) -> HF name (per layer: model.layers.{i}.Y)
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    # A mixture of experts (Qwen's names; Mixtral's in _MIXTRAL_EXPERT_NAMES): the router, the
    # experts stacked [E, out, in] in one tensor each (read per expert: `_expert_slice`), and
    # Qwen2-MoE's shared expert with its gate ([D] in the file, [1, D] in HF's).
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_MIXTRAL_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.w2.weight",
}
# Gemma's norms around the attention and the MLP (llama.cpp's ffn_norm is the MLP's pre-norm in
# both; HF calls it post_attention_layernorm in Llama, pre_feedforward_layernorm in Gemma).
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _reader_and_name(reader_or_path):
    """(reader, file name for messages) from a path or an open `gguf.GGUFReader`."""
    if hasattr(reader_or_path, "fields"):
        return reader_or_path, gguf_file_name(reader_or_path)
    return open_gguf(reader_or_path), os.fspath(reader_or_path)


def model_config_from_gguf(reader_or_path) -> ModelConfig:
    reader, source = _reader_and_name(reader_or_path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: unknown architecture general.architecture={arch!r}; supported GGUF "
            f"architectures: {sorted(GGUF_ARCHITECTURES)}"
        )
    family = _family(reader, arch)

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    tensor_names = {t.name for t in reader.tensors}
    rope_scaling = None
    rope_freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    if rope_freqs:  # Llama 3.1+: llama.cpp's per-frequency divisors instead of llama3 parameters
        factors = np.asarray(rope_freqs[0].data, np.float32).reshape(-1)
        rope_scaling = RopeScaling(
            rope_type="freq_factors", factor=float(factors.max()), freq_factors=tuple(factors)
        )
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{source}: GGUF metadata gives neither vocab_size nor tokens")
        vocab_size = len(tokens.data)
    num_heads = need("attention.head_count")
    hidden = need("embedding_length")
    num_layers = int(need("block_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length")
    head_dim = head_dim or _field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = RopeScaling("linear", float(need("rope.scaling.factor")))
    elif scaling_type not in (None, "none") and rope_scaling is None:
        raise ValueError(f"{source}: unsupported {arch}.rope.scaling.type={scaling_type!r}")
    extra = {}
    if arch in _GEMMA:
        scale = _field(reader, f"{arch}.attention.scale")
        if scale is not None:
            query_pre_attn_scalar = float(f"{float(scale) ** -2:.6g}")  # the file's is float32
        elif num_layers == _GEMMA_27B_LAYERS[arch]:
            query_pre_attn_scalar = hidden / num_heads
        else:
            query_pre_attn_scalar = float(head_dim)
        window = _field(reader, f"{arch}.attention.sliding_window")
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
        if isinstance(pattern, list):  # llama.cpp's per-layer flags: True = sliding
            sliding = [bool(f) for f in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
        caps = _GEMMA_SOFTCAPS[arch]
        extra = dict(
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=query_pre_attn_scalar,
            sliding_window=None if window is None else int(window),
            layer_types=None
            if window is None
            else tuple("sliding_attention" if f else "full_attention" for f in sliding),
            attn_logit_softcapping=_field(reader, f"{arch}.attn_logit_softcapping", caps[0]),
            final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping", caps[1]),
        )
        if arch == "gemma3":
            extra["rope_local_base_freq"] = float(
                _field(reader, f"{arch}.rope.freq_base_swa", 10000.0)
            )
    if family in _MOE_NORM_TOPK:
        extra |= dict(
            num_experts=int(need("expert_count")),
            num_experts_per_tok=int(need("expert_used_count")),
            norm_topk_prob=bool(
                _field(reader, f"{arch}.expert_weights_norm", _MOE_NORM_TOPK[family])
            ),
        )
        expert_ff = _field(reader, f"{arch}.expert_feed_forward_length")
        if expert_ff is not None:
            extra["moe_intermediate_size"] = int(expert_ff)
        shared_ff = _field(reader, f"{arch}.expert_shared_feed_forward_length")
        if shared_ff:
            extra["shared_expert_intermediate_size"] = int(shared_ff)
    # The family's fixed traits; Q/K/V biases are read off the tensors.
    traits = {k: v for k, v in FAMILY_TRAITS[family].items() if k != "attention_bias"}
    traits = {k: v for k, v in traits.items() if k not in extra}  # the file's word wins
    return ModelConfig(
        **extra,
        **traits,
        name=_field(reader, "general.name", "") or "",
        architecture=family,
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=int(num_heads),
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _family(reader, arch: str) -> str:
    """Our architecture for a file of llama.cpp's `arch` (a llama file with experts: Mixtral)."""
    if arch == "llama" and _field(reader, "llama.expert_count"):
        return "mixtral"
    return GGUF_ARCHITECTURES[arch]


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q/K weight [heads*H, D] (or bias [heads*H])."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str = "llama", family: str | None = None) -> str | None:
    """llama.cpp's tensor name in an `arch` file -> HF's (None: a tensor llmjax does not read).
    A stacked expert tensor maps to HF's per-expert name without the expert index
    (`...experts.w1.weight`: `_expert_slice` reads expert e of it)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_BLOCK_NAMES if arch in _GEMMA else _BLOCK_NAMES
    if family == "mixtral":
        names = {**names, **_MIXTRAL_EXPERT_NAMES}
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in names:
            return f"model.layers.{idx}.{names[rest]}"
    return None


# Our weight matrices -> their HF names (per layer), to keep GGUF blocks (`quantized=True`).
_MATRIX_HF_NAMES = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
# HF's name of expert e's weight -> (the stacked tensor's name without ".{e}", e).
_EXPERT = re.compile(r"(?P<head>.*\.experts)\.(?P<e>\d+)(?P<tail>\.\w+\.weight)")
# Our expert stacks -> the stacked tensor's HF-style name after "model.layers.{i}." (Qwen's names;
# Mixtral's second).
_EXPERT_HF_NAMES = {
    "we_gate": ("mlp.experts.gate_proj.weight", "block_sparse_moe.experts.w1.weight"),
    "we_up": ("mlp.experts.up_proj.weight", "block_sparse_moe.experts.w3.weight"),
    "we_down": ("mlp.experts.down_proj.weight", "block_sparse_moe.experts.w2.weight"),
}
# GGUF block types kept quantized -> their PackedWeight format.
PACKED_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


def packed_from_gguf(t, plain_shape, in_ndim: int, out_first: bool = False, num_heads=None):
    """A GGUF tensor of a PACKED_TYPES type -> PackedWeight (blocks split into codes, scales
    and mins, nothing dequantized; `num_heads`: undo llama.cpp's Q/K row permutation, on the
    rows). None for other tensor types."""
    from llmjax.model.quant import from_gguf_blocks

    fmt = PACKED_TYPES.get(t.tensor_type.name)
    if fmt is None:
        return None
    rows = int(t.shape[1]) if len(t.shape) > 1 else 1
    data = np.asarray(t.data, np.uint8).reshape(rows, -1)
    if num_heads is not None:
        data = unpermute_rope_rows(data, num_heads)
    return from_gguf_blocks(data, fmt, plain_shape, in_ndim, out_first)


def packed_experts_from_gguf(t, plain_shape):
    """A stacked expert tensor ([E, out, in] in the file) of a PACKED_TYPES type -> one
    PackedWeight with an experts axis (plain shape [E, *in, *out], each expert's blocks as
    `packed_from_gguf` splits them). None for other tensor types."""
    from llmjax.model.quant import from_gguf_blocks, stack_packed

    fmt = PACKED_TYPES.get(t.tensor_type.name)
    if fmt is None:
        return None
    E, out = int(plain_shape[0]), int(plain_shape[-1])
    data = np.asarray(t.data, np.uint8).reshape(E, out, -1)
    return stack_packed([from_gguf_blocks(data[e], fmt, plain_shape[1:]) for e in range(E)])


def load_gguf(
    reader_or_path, dtype=np.float32, lazy: bool = False, quantized: bool = False
) -> tuple[ModelConfig, Params]:
    """Load a GGUF file (a path or an open reader) -> (ModelConfig, numpy parameter tree in
    `dtype`), dequantizing; with `lazy`, a thunk per weight that dequantizes it when called.
    With `quantized`, the weight matrices (and the embedding) stored in a PACKED_TYPES type stay
    quantized as `llmjax.model.quant.PackedWeight`s; the rest is dequantized."""
    import gguf

    from llmjax.checkpoint.hf import _load_all, params_from_hf_tensors
    from llmjax.model.params import check_params, param_specs
    from llmjax.model.quant import MATRICES

    reader, path = _reader_and_name(reader_or_path)
    config = model_config_from_gguf(reader)
    arch = _field(reader, "general.architecture")
    permuted = arch == "llama"  # llama.cpp's GPT-J-style Q/K rows (see the module doc)
    by_hf_name = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch, config.architecture)
        if name is not None:
            by_hf_name[name] = t
    stacked = {}  # the last stacked expert tensor read: {hf name: [E, out, in]}

    def get(name: str) -> np.ndarray:
        expert = _EXPERT.fullmatch(name)
        if expert is not None and name not in by_hf_name:  # expert e of a stacked tensor
            whole = expert["head"] + expert["tail"]
            if whole not in stacked:
                stacked.clear()  # one stacked tensor held at a time
                stacked[whole] = get(whole)
            w = stacked[whole]
            if w.ndim != 3 or w.shape[0] != config.num_experts:
                raise ValueError(
                    f"{path}: GGUF tensor for {whole!r} has shape {w.shape}, want "
                    f"[{config.num_experts}, out, in]"
                )
            return w[int(expert["e"])]
        t = by_hf_name.get(name)
        if t is None:
            raise ValueError(f"{path}: GGUF tensor for {name!r} is missing")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            w = np.asarray(w, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        except Exception as e:
            raise ValueError(f"{path}: cannot read GGUF tensor {t.name!r}: {e}") from e
        if permuted and ".q_proj." in name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # [D] in the file, HF's [1, D]
        return w

    if not quantized:
        return config, params_from_hf_tensors(config, get, path, dtype, lazy)
    if lazy:
        raise ValueError("quantized GGUF weights load whole (not one shard at a time)")
    params = params_from_hf_tensors(config, get, path, dtype, lazy=True)
    specs = param_specs(config)
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads} if permuted else {}

    def packed_or(thunk, hf, shape, in_ndim, out_first=False, num_heads=None):
        t = by_hf_name.get(hf)
        packed = None if t is None else packed_from_gguf(t, shape, in_ndim, out_first, num_heads)
        return (lambda: packed) if packed is not None else thunk

    mixtral = config.architecture == "mixtral"
    for i, layer in enumerate(params["layers"]):
        for name, in_ndim in MATRICES.items():
            if name not in layer:  # a mixture of experts' layer (below)
                continue
            hf = f"model.layers.{i}.{_MATRIX_HF_NAMES[name]}"
            shape = specs["layers"][i][name].shape
            layer[name] = packed_or(layer[name], hf, shape, in_ndim, num_heads=heads.get(name))
        for name, hf_names in _EXPERT_HF_NAMES.items():
            t = by_hf_name.get(f"model.layers.{i}.{hf_names[mixtral]}")
            if name in layer and t is not None:
                packed = packed_experts_from_gguf(t, specs["layers"][i][name].shape)
                if packed is not None:
                    layer[name] = lambda packed=packed: packed
    if config.tie_word_embeddings:
        params["embed"] = packed_or(
            params["embed"], "model.embed_tokens.weight", specs["embed"].shape, 1, out_first=True
        )
    else:
        params["lm_head"] = packed_or(
            params["lm_head"], "lm_head.weight", specs["lm_head"].shape, 1
        )
    params = _load_all(params)
    check_params(config, params, path)
    return config, params
