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
    D, V = config.hidden_size, config.vocab_size

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

    def experts(name: str, shape: tuple[int, ...], convert):
        # One HF tensor per expert ("{e}" in the name) -> our [E, ...] stack.
        def load() -> np.ndarray:
            return np.stack(
                [convert(take(name.format(e=e), shape)) for e in range(config.num_experts)]
            )

        return load

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        return {
            ours: (experts if "{e}" in hf else weight)(p + hf, shape, to_ours)
            for ours, (hf, shape, to_ours, _) in hf_layer_table(config).items()
        }

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


def hf_layer_table(config: ModelConfig) -> dict[str, tuple]:
    """The one map between a layer's weights in our tree and in HF's checkpoints, for this
    architecture: our name -> (HF name under model.layers.{i}., HF shape, HF -> ours, ours -> HF).
    Gemma's "post_attention_layernorm" is the attention output's post-norm, Llama's the MLP's
    pre-norm (Gemma's is "pre_feedforward_layernorm"). A name with "{e}" is one tensor per
    expert (shape and conversions per expert), stacked on our leading expert axis."""
    D = config.hidden_size
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim

    def same(x):
        return x

    def heads_in(n):  # [n*H, D] <-> [D, n, H]
        return lambda x: x.T.reshape(D, n, H), lambda w: w.reshape(D, n * H).T

    mlp_norm = "pre_feedforward_layernorm.weight" if config.post_norms else None
    mlp_norm = mlp_norm or "post_attention_layernorm.weight"
    table = {
        "attn_norm": ("input_layernorm.weight", (D,), same, same),
        "wq": ("self_attn.q_proj.weight", (N * H, D), *heads_in(N)),
        "wk": ("self_attn.k_proj.weight", (K * H, D), *heads_in(K)),
        "wv": ("self_attn.v_proj.weight", (K * H, D), *heads_in(K)),
        "wo": (
            "self_attn.o_proj.weight",
            (D, N * H),
            lambda x: x.T.reshape(N, H, D),
            lambda w: w.reshape(N * H, D).T,
        ),
        "mlp_norm": (mlp_norm, (D,), same, same),
        **_hf_mlp_table(config),
    }
    if config.qk_norm:
        table["q_norm"] = ("self_attn.q_norm.weight", (H,), same, same)
        table["k_norm"] = ("self_attn.k_norm.weight", (H,), same, same)
    if config.post_norms:
        table["attn_post_norm"] = ("post_attention_layernorm.weight", (D,), same, same)
        table["mlp_post_norm"] = ("post_feedforward_layernorm.weight", (D,), same, same)
    if config.attention_bias:
        for name, n in (("bq", N), ("bk", K), ("bv", K)):
            proj = {"bq": "q", "bk": "k", "bv": "v"}[name]
            table[name] = (
                f"self_attn.{proj}_proj.bias",
                (n * H,),
                lambda x, n=n: x.reshape(n, H),
                lambda b, n=n: b.reshape(n * H),
            )
    return table


def _transposed(rows: int, cols: int) -> tuple:
    """An HF [out, in] = [rows, cols] linear <-> ours [in, out]: (shape, HF -> ours, ours -> HF)."""
    return (rows, cols), lambda x: x.T, lambda w: w.reshape(cols, rows).T


def _hf_mlp_table(config: ModelConfig) -> dict[str, tuple]:
    """`hf_layer_table`'s MLP rows: a dense MLP (mlp.*_proj), or experts: Mixtral's
    block_sparse_moe.{gate, experts.{e}.w1/w3/w2} (gate, up, down), Qwen's mlp.{gate,
    experts.{e}.*_proj} and Qwen2-MoE's shared expert (mlp.shared_expert.*_proj and its gate
    mlp.shared_expert_gate [1, D])."""
    D = config.hidden_size

    def gated(prefix: str, F: int, names=("gate_proj", "up_proj", "down_proj"), ours="w_"):
        gate, up, down = names
        return {
            f"{ours}gate": (f"{prefix}{gate}.weight", *_transposed(F, D)),
            f"{ours}up": (f"{prefix}{up}.weight", *_transposed(F, D)),
            f"{ours}down": (f"{prefix}{down}.weight", *_transposed(D, F)),
        }

    if not config.is_moe:
        return gated("mlp.", config.intermediate_size)
    E, Fe = config.num_experts, config.expert_intermediate_size
    if config.architecture == "mixtral":
        prefix, names = "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        prefix, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    table = {
        "router": (f"{prefix}gate.weight", *_transposed(E, D)),
        **gated(prefix + "experts.{e}.", Fe, names, ours="we_"),
    }
    Fs = config.shared_expert_intermediate_size
    if Fs:
        table |= gated("mlp.shared_expert.", Fs, ours="ws_")
        table["ws_score"] = (
            "mlp.shared_expert_gate.weight",
            (1, D),
            lambda x: x.reshape(D),
            lambda w: w.reshape(1, D),
        )
    return table


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

        # Gemma 3's multimodal checkpoints keep the text decoder under model.language_model.
        # (transformers >= 4.52) or language_model.model. (before); the vision tower is ignored.
        for prefix in ("model.language_model.", "language_model.model."):
            if "model.embed_tokens.weight" not in where and prefix + "embed_tokens.weight" in where:
                head = "language_model.lm_head.weight"
                where |= {
                    "model." + n[len(prefix) :]: w for n, w in where.items() if n.startswith(prefix)
                }
                if head in where:
                    where["lm_head.weight"] = where[head]

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


# ----------------------------------------------------------------------------------------------
# Writing: our tree -> an HF directory (the inverse of params_from_hf_tensors and
# ModelConfig.from_hf_config), readable by load_hf, transformers and vLLM.

# architecture -> (HF class, model_type)
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}


def hf_tensors_from_params(
    config: ModelConfig, params: Params, dtype=None
) -> dict[str, np.ndarray]:
    """HF tensor name -> contiguous numpy array in HF's layout ([out, in]), in `dtype` (default:
    as stored). `params` may be numpy or jax arrays, in the list or the stacked layer layout."""
    from llmjax.model.params import unstack_layers

    check_params(config, params, "params")
    params = unstack_layers(params)

    def hf(x, convert=lambda x: x) -> np.ndarray:
        x = np.asarray(x)
        return np.ascontiguousarray(convert(x).astype(dtype or x.dtype))

    out = {"model.embed_tokens.weight": hf(params["embed"])}  # [V, D]
    table = hf_layer_table(config)
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        for ours, (name, _, _, to_hf) in table.items():
            if "{e}" in name:  # our [E, ...] stack -> one tensor per expert
                w = np.asarray(layer[ours])
                out |= {p + name.format(e=e): hf(w[e], to_hf) for e in range(w.shape[0])}
            else:
                out[p + name] = hf(layer[ours], to_hf)
    out["model.norm.weight"] = hf(params["final_norm"])
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = hf(params["lm_head"], lambda w: w.T)  # [D, V] -> [V, D]
    return out


def _hf_rope_scaling(config: ModelConfig) -> dict | None:
    """config.json's rope_scaling. llama.cpp's per-frequency divisors (`freq_factors`, from a
    Llama 3.1+ GGUF) have no HF spelling: they are matched to the llama3 parameters they were
    computed from (Meta's published ones), or refused."""
    from llmjax.config import RopeScaling

    s = config.rope_scaling
    if s is None:
        return None
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.rope_type == "freq_factors":
        from llmjax.model.layers import rope_inv_freq

        want = rope_inv_freq(config.head_dim, config.rope_theta, s)
        for original in (8192, 4096, 2048, 16384, 32768, 131072):
            guess = RopeScaling(
                rope_type="llama3",
                factor=round(s.factor, 4),
                original_max_position_embeddings=original,
            )
            got = rope_inv_freq(config.head_dim, config.rope_theta, guess)
            if np.allclose(got, want, rtol=1e-5, atol=0):
                s = guess
                break
        else:
            raise ValueError(
                f"rope freq_factors {s.freq_factors[:4]}... match no llama3 rope_scaling "
                "(factor = their largest, low/high_freq_factor 1/4); HF configs cannot express them"
            )
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }


def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict:
    """`config.json` of an HF model with this shape (every field transformers' LlamaConfig /
    MistralConfig / Qwen2Config reads); ModelConfig.from_hf_config reads it back equal."""
    if config.architecture not in HF_ARCHITECTURES:
        raise ValueError(f"no HF class for architecture {config.architecture!r}")
    if config.architecture == "llama" and config.sliding_window is not None:
        raise ValueError(
            f"HF's LlamaConfig has no sliding window ({config.sliding_window=}); "
            "use architecture='mistral'"
        )
    if config.architecture in ("qwen2", "qwen2_moe") and not config.attention_bias:
        raise ValueError("HF's Qwen2 always has Q/K/V biases; this config has none")
    from llmjax.config import FAMILY_TRAITS

    differ = {
        k: getattr(config, k)
        for k, v in FAMILY_TRAITS[config.architecture].items()
        if getattr(config, k) != v and k != "attention_bias"
    }
    if differ:
        raise ValueError(
            f"HF's {config.architecture} class fixes what this config changes: {differ}"
        )
    hf_class, model_type = HF_ARCHITECTURES[config.architecture]
    eos = list(config.eos_token_ids)
    out = {
        "architectures": [hf_class],
        "model_type": model_type,
        "_name_or_path": config.name,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": _hf_rope_scaling(config),
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if config.architecture in ("gemma2", "gemma3"):
        out |= {
            "hidden_activation": config.hidden_act,
            "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
            "attn_logit_softcapping": config.attn_logit_softcapping,
            "final_logit_softcapping": config.final_logit_softcapping,
            "sliding_window": config.sliding_window,
            "layer_types": [config.layer_type(i) for i in range(config.num_layers)],
        }
        if config.architecture == "gemma3":
            out["rope_local_base_freq"] = config.rope_local_base_freq or config.rope_theta
    elif config.query_pre_attn_scalar or config.attn_logit_softcapping or config.layer_types:
        raise ValueError(f"HF's {config.architecture} config has no Gemma fields: use gemma2/3")
    elif config.final_logit_softcapping or config.hidden_act != "silu":
        raise ValueError(f"HF's {config.architecture} config has no final soft cap or GeGLU")
    if config.is_moe:
        if config.architecture not in ("mixtral", "qwen2_moe", "qwen3_moe"):
            raise ValueError(f"HF's {config.architecture} has no experts: use mixtral/qwen*_moe")
        if config.architecture == "mixtral" and config.moe_intermediate_size not in (
            None,
            config.intermediate_size,
        ):
            raise ValueError("HF's Mixtral experts are intermediate_size wide")
        if config.shared_expert_intermediate_size and config.architecture != "qwen2_moe":
            raise ValueError("only HF's Qwen2-MoE has a shared expert")
        if config.architecture == "qwen2_moe" and not config.shared_expert_intermediate_size:
            raise ValueError("HF's Qwen2-MoE always has a shared expert")
        out |= {
            "num_local_experts" if config.architecture == "mixtral" else "num_experts": (
                config.num_experts
            ),
            "num_experts_per_tok": config.num_experts_per_tok,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
        }
        if config.architecture != "mixtral":
            out |= {
                "moe_intermediate_size": config.expert_intermediate_size,
                "norm_topk_prob": config.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        if config.shared_expert_intermediate_size:
            out["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if config.architecture in ("mistral", "mixtral"):
        out["sliding_window"] = config.sliding_window
    if config.architecture in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        out["use_sliding_window"] = config.sliding_window is not None
        out["sliding_window"] = config.sliding_window
        out["max_window_layers"] = config.num_layers
    return out


def save_hf(
    out_dir: str | os.PathLike,
    config: ModelConfig,
    params: Params,
    tokenizer_source=None,
    dtype: str = "float32",
) -> str:
    """Write an HF model directory: config.json, generation_config.json, model.safetensors (in
    `dtype`: float32, bfloat16 or float16) and, given `tokenizer_source` (a .gguf file, an HF
    directory, or an `llmjax.tokenizer.Tokenizer`), tokenizer.json and tokenizer_config.json.
    Returns `out_dir`."""
    from safetensors.numpy import save_file

    from llmjax.config import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"{dtype=} must be one of {DTYPES}")
    if dtype == "bfloat16":
        import jax.numpy as jnp

        np_dtype = np.dtype(jnp.bfloat16)  # ml_dtypes' bfloat16, which safetensors writes as BF16
    else:
        np_dtype = np.dtype(dtype)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = hf_tensors_from_params(config, params, np_dtype)
    # "format": "pt" is what transformers checks before it reads a safetensors file.
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), hf_config_dict(config, dtype))
    eos = list(config.eos_token_ids)
    generation = {"bos_token_id": config.bos_token_id}
    generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    if tokenizer_source is not None:
        save_hf_tokenizer(out_dir, tokenizer_source, config.max_position_embeddings)
    return out_dir


def save_hf_tokenizer(out_dir: str, source, model_max_length: int | None = None) -> None:
    """tokenizer.json (the `tokenizers` pipeline our Tokenizer runs: for a GGUF, the one rebuilt
    from its vocabulary and merges) and tokenizer_config.json (special tokens, the chat
    template). `source`: a .gguf file, an HF directory or a Tokenizer."""
    from llmjax.tokenizer import Tokenizer

    tok = source
    if not isinstance(tok, Tokenizer):
        path = os.fspath(source)
        tok = Tokenizer.from_hf_dir(path) if os.path.isdir(path) else Tokenizer.from_gguf(path)
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))

    def token(token_id: int | None) -> str | None:
        return tok.id_to_token(token_id) if token_id is not None else None

    eos_id = tok.eos_token_id
    probe = tok.backend.encode("a", add_special_tokens=True).ids
    config = {
        # The generic fast tokenizer runs tokenizer.json as it is (a model-specific class may
        # rebuild parts of the pipeline, e.g. the pre-tokenizer, from its own defaults).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tok.bos_token_id),
        "eos_token": token(eos_id),
        "pad_token": token(tok.pad_token_id),
        "unk_token": token(tok.unk_token_id),
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": eos_id is not None and probe[-1:] == [eos_id],
        "clean_up_tokenization_spaces": False,
        "chat_template": tok.chat_template,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
