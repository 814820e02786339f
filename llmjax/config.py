"""Frozen, validated configuration dataclasses.

Configs are split by concern (model shape, KV cache, scheduler, engine), checked in `__post_init__`
with errors that name the offending values, and changed with `dataclasses.replace` (nested fields
by dotted path: `apply_overrides(config, {"scheduler.lpm_max_queue_len": 64})`, which the scripts'
`--override` flag uses). Presets live in the top-level `configs/` package as Python constants. No
module here imports jax (the Mosaic GPU kernels' shape limits are their modules', imported only
when `pallas_kernel="mgpu"` is asked for).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Shapes the simulated device (llmjax/sim/) models but the JAX model does not implement: OPT (two
# MLP matrices, ReLU, learned positions) and Falcon (two MLP matrices, GELU, attention and MLP in
# parallel). A preset of these runs only with EngineConfig.device='sim'.
SIM_ONLY_ARCHITECTURES = ("opt", "falcon")


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `llama3`: Llama 3.1's wavelength-dependent scaling (long wavelengths divided by `factor`, short
    ones kept, a smooth ramp between `high_freq_factor` and `low_freq_factor`).
    `linear`: every frequency divided by `factor` (position interpolation).
    `freq_factors`: frequency i divided by `freq_factors[i]` (head_dim / 2 of them): llama.cpp's
    `rope_freqs` tensor, which GGUF files of Llama 3.1+ carry instead of the llama3 parameters
    (`factor` is then their largest, for information).
    """

    rope_type: Literal["llama3", "linear", "freq_factors"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear", "freq_factors"):
            raise ValueError(
                f"unsupported {self.rope_type=}; llmjax implements 'llama3', 'linear' and "
                "'freq_factors'"
            )
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))
        if (self.rope_type == "freq_factors") != bool(self.freq_factors):
            raise ValueError(
                f"freq_factors go with rope_type='freq_factors' (and it needs them): "
                f"{self.rope_type=}, {len(self.freq_factors)} factors"
            )
        if any(not f > 0 for f in self.freq_factors):
            raise ValueError(f"freq_factors must be positive: {self.freq_factors}")
        _check_positive(self, "factor", "original_max_position_embeddings")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs {self.high_freq_factor=} > {self.low_freq_factor=}"
            )

    @classmethod
    def from_hf(cls, d: dict | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type in ("default", None):
            return None
        if rope_type not in ("llama3", "linear"):
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r} in {d}; llmjax implements 'llama3' "
                "and 'linear'"
            )
        kwargs = {"rope_type": rope_type, "factor": float(d["factor"])}
        if rope_type == "llama3":
            kwargs |= {
                "low_freq_factor": float(d["low_freq_factor"]),
                "high_freq_factor": float(d["high_freq_factor"]),
                "original_max_position_embeddings": int(d["original_max_position_embeddings"]),
            }
        return cls(**kwargs)


# The architecture table (DESIGN principle 17), by family. FAMILY_TRAITS: what a family fixes
# that its config.json does not say (ModelConfig fields). HF_MODEL_TYPES: HF's model_type ->
# ours. HF_DEFAULTS: what transformers' config class assumes for keys a config.json may omit
# ("pattern": every pattern-th layer is global, for configs without layer_types).
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": {"norm_plus_one": True, "post_norms": True, "scale_embeddings": True},
    "gemma3": {
        "qk_norm": True,
        "norm_plus_one": True,
        "post_norms": True,
        "scale_embeddings": True,
    },
    # Mixtral: every top-k routing renormalized (HF's MixtralTopKRouter has no flag).
    "mixtral": {"norm_topk_prob": True},
    "qwen2_moe": {"attention_bias": True},
    "qwen3_moe": {"qk_norm": True},
}
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}
_GEMMA_DEFAULTS = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"rms_norm_eps": 1e-6, "head_dim": 128},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6},
    "qwen2_moe": {
        "rms_norm_eps": 1e-6,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        "rms_norm_eps": 1e-6,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "gemma2": {
        **_GEMMA_DEFAULTS,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "pattern": 2,
    },
    "gemma3": {
        **_GEMMA_DEFAULTS,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "pattern": 6,
    },
}


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


class AttentionKind(typing.NamedTuple):
    """What one layer's attention is, as the layer scan's per-layer table sees it: its sliding
    window (None: full) and its RoPE (base and scaling)."""

    window: int | None
    rope_theta: float
    rope_scaling: RopeScaling | None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder: the architecture table (DESIGN principle 17). Every family llmjax runs
    (Llama 2/3, Mistral, Qwen2, SmolLM2, Qwen3, Gemma 2, Gemma 3) is these fields; the defaults are
    Llama's, and llmjax/model/llama.py reads them as data.

    Attributes follow HF names where they exist. `head_dim` defaults to hidden_size / num_heads
    (Gemma and Qwen3 set it apart). `attention_bias` adds biases to the Q/K/V projections (Qwen2).

    What the families differ in:
      qk_norm                 RMSNorm over each head's query and key, before RoPE (Qwen3, Gemma 3)
      norm_plus_one           RMSNorm scales by (1 + w), computed in float32 (Gemma); else by w,
                              the normalized x rounded to its dtype first (Llama)
      post_norms              RMSNorm on the attention and MLP outputs before each residual add
                              (Gemma 2/3: HF's post_attention_layernorm, post_feedforward_layernorm)
      scale_embeddings        embeddings times sqrt(hidden_size), in the activations' dtype (Gemma)
      query_pre_attn_scalar   scores scaled by query_pre_attn_scalar ** -0.5 instead of
                              head_dim ** -0.5 (Gemma)
      attn_logit_softcapping  scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
      final_logit_softcapping logits -> cap * tanh(logits / cap) (Gemma 2)
      hidden_act              'silu' (SwiGLU) or 'gelu_pytorch_tanh' (GeGLU: Gemma)
      layer_types             per layer 'full_attention' or 'sliding_attention' (a window of
                              `sliding_window` keys): Gemma 2 alternates, Gemma 3 has five local
                              layers to one global. None: every layer alike, sliding where
                              `sliding_window` is set (Mistral), else full.
      rope_local_base_freq    the RoPE base of sliding layers (Gemma 3; None: rope_theta). Sliding
                              layers never take `rope_scaling` when it is set.
      num_experts             experts per MoE layer (Mixtral, Qwen2/3-MoE); 0: a dense gated MLP.
                              Every layer is MoE when set (HF's mlp_only_layers and
                              decoder_sparse_step > 1 are refused)
      num_experts_per_tok     top-k: each token's MLP is the weighted sum of its k experts
      moe_intermediate_size   an expert's hidden dim (Qwen; None: intermediate_size, Mixtral)
      norm_topk_prob          the k routing weights renormalized to sum to 1 (Mixtral always,
                              Qwen3-MoE where its config says so); else the softmax's own values
      shared_expert_intermediate_size  hidden dim of an expert every token takes, gated by
                              sigmoid(x . w) (Qwen2-MoE); 0: none
    `attention_kinds` / `layer_kind_ids` give the distinct per-layer kinds (window, RoPE) and
    each layer's index into them: the per-layer table the layer scan carries.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False
    norm_plus_one: bool = False
    post_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    architecture: str = "llama"
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = ""

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"{self.hidden_size=} must be divisible by {self.num_heads=} when head_dim "
                    "is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
            "rope_theta",
            "rms_norm_eps",
            "sliding_window",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_base_freq",
        )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported {self.hidden_act=}; llmjax implements {HIDDEN_ACTS}")
        if self.layer_types is not None:
            types_ = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", types_)
            bad = sorted(set(types_) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"unknown layer_types {bad}; each layer is one of {LAYER_TYPES}")
            if len(types_) != self.num_layers:
                raise ValueError(f"{len(types_)} layer_types for {self.num_layers=}")
            if "sliding_attention" in types_ and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but no sliding_window")
            if len(set(types_)) == 1:  # uniform: the plain form, so equal configs compare equal
                object.__setattr__(self, "layer_types", None)
                if types_[0] == "full_attention":
                    object.__setattr__(self, "sliding_window", None)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be divisible by {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even for rotary embeddings")
        factors = self.rope_scaling.freq_factors if self.rope_scaling else ()
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"{len(factors)} rope freq_factors for {self.head_dim=} "
                f"(want head_dim / 2 = {self.head_dim // 2})"
            )
        if self.architecture not in SUPPORTED_ARCHITECTURES + SIM_ONLY_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
                f" (and, simulated only, {SIM_ONLY_ARCHITECTURES})"
            )
        if self.num_experts:
            _check_positive(self, "num_experts_per_tok", "moe_intermediate_size")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"{self.num_experts_per_tok=} exceeds {self.num_experts=} (top-k of E experts)"
                )
        elif self.num_experts < 0 or self.shared_expert_intermediate_size:
            raise ValueError(
                f"{self.num_experts=}: a shared expert or a negative count needs num_experts > 0"
            )
        elif self.architecture in MOE_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} needs num_experts > 0")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"{self.shared_expert_intermediate_size=} must be >= 0")
        if isinstance(self.eos_token_ids, list):
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts (`num_experts` > 0)."""
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        """One expert's hidden dim: moe_intermediate_size (Qwen), else intermediate_size."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, i: int) -> str:
        """Layer i's attention: 'full_attention' or 'sliding_attention'."""
        if self.layer_types is not None:
            return self.layer_types[i]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: full attention)."""
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    @property
    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        """The distinct kinds of layer, in order of first appearance (one for Llama)."""
        return tuple(dict.fromkeys(self._layer_kind(i) for i in range(self.num_layers)))

    @property
    def layer_kind_ids(self) -> tuple[int, ...]:
        """Each layer's index into `attention_kinds`: the per-layer table of the layer scan."""
        kinds = {k: j for j, k in enumerate(self.attention_kinds)}
        return tuple(kinds[self._layer_kind(i)] for i in range(self.num_layers))

    @property
    def sliding_layers(self) -> int:
        """How many layers attend over a sliding window."""
        return sum(self.layer_window(i) is not None for i in range(self.num_layers))

    def _layer_kind(self, i: int) -> AttentionKind:
        window = self.layer_window(i)
        if window is not None and self.rope_local_base_freq is not None:
            return AttentionKind(window, self.rope_local_base_freq, None)
        return AttentionKind(window, self.rope_theta, self.rope_scaling)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------
    # Constructors from checkpoint metadata.

    @classmethod
    def from_hf_config(cls, config: dict | str | os.PathLike) -> ModelConfig:
        """From an HF `config.json` (a dict, the file, or the directory that holds it)."""
        source = "<dict>"
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise FileNotFoundError(f"HF config not found: {path}")
            source = path
            try:
                with open(path) as f:
                    config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        if config.get("model_type") == "gemma3" and "text_config" in config:
            # Gemma 3's multimodal checkpoint: the text decoder's config is nested (its weights
            # under model.language_model.*: llmjax/checkpoint/hf.py reads them).
            config = {"model_type": "gemma3_text", **config["text_config"]}
        model_type = HF_MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = config.get("architectures")
            raise ValueError(
                f"unknown architecture model_type={config.get('model_type')!r} "
                f"(architectures={archs}) in {source}; supported: {sorted(HF_MODEL_TYPES)}"
            )
        if config.get("use_bidirectional_attention"):
            raise ValueError(
                f"{source}: bidirectional attention (an embedding model) is not a decoder"
            )
        config = {**HF_DEFAULTS.get(model_type, {}), **config}
        try:
            eos = config.get("eos_token_id", 2)
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            # transformers >= 5 writes rope_parameters {rope_type, rope_theta, scaling keys}, per
            # layer type for Gemma 3 ({full_attention: {...}, sliding_attention: {...}}); older
            # configs have rope_theta, rope_scaling (and rope_local_base_freq) at the top level.
            rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
            local_theta = config.get("rope_local_base_freq")
            if "full_attention" in rope:
                local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
                rope = dict(rope["full_attention"] or {})
            rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
            sliding_window = config.get("sliding_window")
            qwen = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
            if model_type in qwen and not config.get("use_sliding_window", False):
                sliding_window = None
            num_layers = config["num_hidden_layers"]
            layer_types = config.get("layer_types")
            if layer_types is None and sliding_window is not None and "pattern" in config:
                # Older Gemma configs: every `pattern`-th layer is global, the others slide.
                pattern = config.get("sliding_window_pattern") or config["pattern"]
                layer_types = [
                    "sliding_attention" if (i + 1) % pattern else "full_attention"
                    for i in range(num_layers)
                ]
            if layer_types is not None and sliding_window is None:
                layer_types = None  # Qwen's layer_types name sliding layers only when it slides
            num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
            if num_experts and (
                config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1
            ):
                raise ValueError(
                    f"{source}: dense MLP layers among the MoE layers (mlp_only_layers="
                    f"{config.get('mlp_only_layers')}, decoder_sparse_step="
                    f"{config.get('decoder_sparse_step')}) are not supported: llmjax's MoE "
                    "models have experts in every layer"
                )
            moe = {}
            if num_experts:
                moe = dict(
                    num_experts=num_experts,
                    num_experts_per_tok=int(config["num_experts_per_tok"]),
                    moe_intermediate_size=config.get("moe_intermediate_size"),
                    norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(
                        config.get("shared_expert_intermediate_size") or 0
                    ),
                )
            fields = dict(
                **moe,
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_layers=num_layers,
                num_heads=config["num_attention_heads"],
                num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                head_dim=config.get("head_dim"),
                max_position_embeddings=config.get("max_position_embeddings", 4096),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
                rope_scaling=RopeScaling.from_hf(rope),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                sliding_window=sliding_window,
                query_pre_attn_scalar=_float_or_none(config.get("query_pre_attn_scalar")),
                attn_logit_softcapping=_float_or_none(config.get("attn_logit_softcapping")),
                final_logit_softcapping=_float_or_none(config.get("final_logit_softcapping")),
                hidden_act=config.get("hidden_activation") or config.get("hidden_act", "silu"),
                layer_types=tuple(layer_types) if layer_types is not None else None,
                rope_local_base_freq=_float_or_none(local_theta),
                architecture=model_type,
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=config.get("_name_or_path", ""),
            )
        except KeyError as e:
            raise ValueError(f"HF config {source} lacks required key {e.args[0]!r}") from e
        return cls(**(fields | FAMILY_TRAITS[model_type]))

    @classmethod
    def from_gguf(cls, reader_or_path) -> ModelConfig:
        """From the metadata of a GGUF file (a path or a `gguf.GGUFReader`)."""
        from llmjax.checkpoint.gguf import model_config_from_gguf

        return model_config_from_gguf(reader_or_path)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_pages` pages of `page_size` tokens for every layer.

    `num_pages=None` sizes the cache from `max_num_seqs * max_model_len` (capped by
    `memory_fraction` of device memory where the backend reports it). Page 0 is reserved as the
    sink for padded writes and never handed to a request.

    `prefix_cache` names how KV pages are reused across requests that share a prefix (a system
    prompt, few-shot examples, earlier chat turns): 'radix' (SGLang's RadixAttention: a radix
    tree of whole pages with LRU eviction, evicted before anyone is preempted; the default, as in
    SGLang and vLLM v1) or 'none' (every request computes its whole prompt). See
    llmjax/engine/radix_cache.py.
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.5
    watermark: float = 0.01  # fraction of pages a new admission must leave free (vLLM)
    prefix_cache: str = "radix"

    def __post_init__(self):
        _check_positive(self, "page_size", "num_pages")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"unknown {self.prefix_cache=}; choose one of {PREFIX_CACHES}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"{self.watermark=} must be in [0, 1)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"{self.num_pages=} must be >= 2 (page 0 is the reserved sink)")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"{self.memory_fraction=} must be in (0, 1]")


KV_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
KV_LOAD_POLICIES = ("cost", "always", "never")
KV_HOST_MEMORIES = ("auto", "pinned_host", "numpy")


@dataclasses.dataclass(frozen=True)
class KVStoreConfig:
    """The KV tiers below the device pages (Mooncake's KV-centric store, issue 22;
    llmjax/kvstore/, llmjax/engine/kv_tiers.py). Off unless a tier is given.

    T1 `host_blocks` blocks in host memory (0: none); T2 block files in `disk_dir` ('' none), at
    most `disk_blocks`, fsynced with `disk_fsync` (durable across power loss; without it a torn
    file fails its checksum and is recomputed); T3 Mooncake Store at `mooncake_master`
    ('host:port' of its RPC service; `mooncake_metadata` its HTTP metadata URL, default on that
    host at port 8080; `mooncake_namespace` prefixes this engine's keys). A block is
    `block_size` tokens (a multiple of the page size; the paper's 256, the traces' 512).

    `write_policy` (SGLang HiCache's names) moves blocks down, T0 -> T1 and T1 -> T2:
    'write_through' (every full block), 'write_through_selective' (a block reused
    `write_through_threshold` times; the default) or 'write_back' (when the tier above evicts
    it). `load_policy`, for a prompt whose prefix a lower tier holds: 'cost' (load it if the
    modeled copy, latency + bytes / bandwidth per tier, beats recomputing those tokens at the
    engine's measured prefill rate, `prefill_tokens_per_s` until it has measured one; the
    default), 'always' or 'never' (recompute). `*_bandwidth` (bytes/s) and `*_latency` (s per
    block) are the cost model's tiers (defaults: what `scripts/bench_kvstore.py --mode micro`
    fitted for SmolLM2 on a 2-core CPU host, 2026-12-02, the copy into the device included; it
    prints these flags for another machine). `host_memory`: where a block's copy out of the
    device lands before it is stored in T1's numpy pool: 'pinned_host' memory (one DMA; TPU,
    GPU and JAX's CPU backend have it), 'numpy' (device memory, copied out to pageable memory),
    or 'auto' (pinned_host where every device has it).
    """

    host_blocks: int = 0
    disk_dir: str = ""
    disk_blocks: int = 65536
    disk_fsync: bool = False
    mooncake_master: str = ""
    mooncake_metadata: str = ""
    mooncake_namespace: str = "llmjax"
    block_size: int = 256
    write_policy: str = "write_through_selective"
    write_through_threshold: int = 2
    load_policy: str = "cost"
    prefill_tokens_per_s: float = 1000.0
    host_bandwidth: float = 2.65e9
    host_latency: float = 1.2e-4
    disk_bandwidth: float = 4.2e8
    disk_latency: float = 1e-4
    mooncake_bandwidth: float = 5.5e8
    mooncake_latency: float = 5e-5
    host_memory: str = "auto"

    def __post_init__(self):
        _check_positive(self, "block_size", "write_through_threshold", "prefill_tokens_per_s")
        if self.host_blocks < 0 or self.disk_blocks < 1:
            raise ValueError(f"need {self.host_blocks=} >= 0 and {self.disk_blocks=} >= 1")
        if self.write_policy not in KV_WRITE_POLICIES:
            raise ValueError(f"unknown {self.write_policy=}; choose one of {KV_WRITE_POLICIES}")
        if self.load_policy not in KV_LOAD_POLICIES:
            raise ValueError(f"unknown {self.load_policy=}; choose one of {KV_LOAD_POLICIES}")
        if self.host_memory not in KV_HOST_MEMORIES:
            raise ValueError(f"unknown {self.host_memory=}; choose one of {KV_HOST_MEMORIES}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_blocks or self.disk_dir or self.mooncake_master)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Who runs each step: the policy, and at most `max_num_seqs` requests and
    `max_num_batched_tokens` tokens (the token budget, Sarathi-Serve's chunk_size) per step.

    Policies (ALGORITHMS.md §3-4):
      sarathi        stall-free: decodes, then ongoing prefill chunks, then new prompts chunked to
                     the budget left (Sarathi-Serve). The default.
      prefill_first  vLLM's classic policy: whole new prompts in prefill-only steps that pause all
                     decodes; decode-only steps otherwise.
      decode_first   request-level batching (FasterTransformer): new requests join only when no
                     request is running.
      splitfuse      Dynamic SplitFuse (DeepSpeed-FastGen): decodes, then prompt pieces filling the
                     budget exactly; pages are taken per chunk.
    The whole-prompt policies need `max_num_batched_tokens >= max_model_len` (checked by
    EngineConfig).

    `admission_order` orders the admission of waiting requests (never the running ones, whose
    decodes and prefill chunks keep their stall-free priority; preempted requests stay first):
      fcfs  arrival order.
      lpm   SGLang's longest-prefix-match: most prefix-cached tokens first. Its guards: with more
            than `lpm_max_queue_len` (128) waiting it falls back to FCFS (matching every request
            each step costs too much); a request whose cache hit is at most
            `in_batch_prefix_len` (32) tokens but whose first `in_batch_prefix_len` tokens equal
            an earlier waiting request's goes last, so the earlier one fills the cache first.

    `latency_token_budget` (Parrot's LATENCY criteria inside Sarathi's budget, ALGORITHMS.md
    §13.5; None: off): while a request that a program tagged LATENCY (`ProgramHints`,
    llmjax/program/) runs, LATENCY requests are scheduled first and all other requests together
    get at most this many tokens of each step (decodes included; 0 pauses them), so their
    prefill chunks cannot stretch the latency requests' time between tokens. Requests without
    hints are scheduled as always.

    `balance_micro_batches` (pipeline parallelism only): cap each micro-batch's decodes at
    ceil(decoding requests / pp), so the decodes spread evenly over the pp micro-batches in
    flight. Off by default, as in Sarathi-Serve's code, where a micro-batch takes every decode
    not in flight: the split that the first admissions leave (say 6 + 2 decodes) then never
    changes, and every tick runs both stages at the size of the larger one.

    `fit_to_buckets` (the chunking policies, sarathi and splitfuse): a step is padded to its
    token bucket (`EngineConfig.token_buckets_per_octave`), and where work runs out below the
    budget, the step's last prefill chunk is cut down to the bucket below when that defers
    fewer tokens than the padding it saves (16 decodes + a 437-token chunk = 453 tokens, padded
    to 512, runs as 448 and leaves 5 tokens for the next step). The chunk cut is the last of its
    prompt (a chunk cut short by the budget leaves no padding), so its request's first token
    comes a step later: only steps cut down to `fit_min_tokens` tokens or more are cut, where
    the padding costs in proportion (below it a step's time hardly depends on its tokens).
    Off: the authors' chunking, every chunk as long as the budget and the prompt allow.
    """

    policy: str = "sarathi"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    admission_order: str = "fcfs"
    lpm_max_queue_len: int = 128
    in_batch_prefix_len: int = 32
    balance_micro_batches: bool = False
    latency_token_budget: int | None = None
    fit_to_buckets: bool = True
    fit_min_tokens: int = 128

    def __post_init__(self):
        _check_positive(
            self,
            "fit_min_tokens",
            "max_num_seqs",
            "max_num_batched_tokens",
            "lpm_max_queue_len",
            "in_batch_prefix_len",
        )
        if self.latency_token_budget is not None and not (
            isinstance(self.latency_token_budget, int) and self.latency_token_budget >= 0
        ):
            raise ValueError(
                f"latency_token_budget must be an integer >= 0 or None, got "
                f"{self.latency_token_budget=}"
            )
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"unknown {self.policy=}; choose one of {SCHEDULER_POLICIES}")
        if self.admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"unknown {self.admission_order=}; choose one of {ADMISSION_ORDERS}")

    @property
    def chunks_prefills(self) -> bool:
        return self.policy in ("sarathi", "splitfuse")


SCHEDULER_POLICIES = ("sarathi", "prefill_first", "decode_first", "splitfuse")
ADMISSION_ORDERS = ("fcfs", "lpm")
PREFIX_CACHES = ("none", "radix")  # implemented in llmjax/engine/radix_cache.py


DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("jax", "sim")
QUANTIZATIONS = ("none", "int8", "int8_wo", "q8_0", "q4_0", "q4_1", "gguf")  # llmjax/model/quant.py
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "cpu")
FLASH_PREFILL_MODES = ("auto", "on", "off")
PALLAS_KERNELS = ("auto", "tpu", "gpu", "mgpu")
LAYER_LOOPS = ("auto", "scan", "unroll")


PROGRAM_MODES = ("parrot", "request")


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
    """How a `llmjax.program.ProgramExecutor` serves semantic-variable programs (Parrot, OSDI'24;
    ALGORITHMS.md §9.2). Names are Parrot's.

    `mode`: 'parrot' (the service receives the program's DAG: a call is dispatched as soon as
    its inputs are computed, under the policies below) or 'request' (the request-level
    baseline: the client awaits each call's output and then sends the calls that need it, so
    every dependent call waits `client_rtt_s` more (the round trip), and the engine sees plain
    requests with no criteria; the policies below are off).

    Parrot's global scheduler (each switchable):
      app_fifo     the ready queue is ordered by depth, deepest first (calls further along their
                   application go first), and the engine orders each application's requests by
                   the application's arrival (`ProgramHints.app_arrival_time`).
      graph_group  ready calls that feed a common consumer (the map stage of a map-reduce)
                   are dispatched together, to one engine, counted as one task against a
                   LATENCY cap.
      ctx_group    ready calls whose prompts share at least `ctx_min_tokens` leading tokens are
                   dispatched together (when graph_group does not group them).
      ctx_aware    among the engines that may take a group, one that holds its prompt's prefix
                   (at least `ctx_min_tokens` of it in its prefix cache, or dispatched there)
                   wins; then `placement` decides.
    `placement` among the engines that may take a group (after ctx_aware): 'pack' (Parrot's
    code: the lowest task cap first, so LATENCY tasks join engines already capped, then the
    least remaining token capacity, best fit) or 'spread' (the fewest tasks, then the most
    remaining token capacity: a load balancer, as the comment in Parrot's code describes it).
    Criteria (deduced back from each `get`): LATENCY calls carry `latency_tasks_num_upperbound`
    (4, Parrot's): an engine holding one takes at most that many tasks, so latency calls run in
    small batches; THROUGHPUT calls carry no cap. `latency_tokens_num_upperbound` (None: off)
    caps an engine holding a LATENCY call at that many prompt tokens the same way; Parrot's code
    sets 4096 in its annotation but never checks it, so by default it is not checked here
    either. An engine also takes at most `tasks_capacity` tasks and `tokens_capacity` prompt
    tokens (None: no task bound, and its KV cache's tokens), an empty engine any one task.
    `max_queue_size` ready calls wait at most (more fail the submission).
    """

    mode: str = "parrot"
    app_fifo: bool = True
    graph_group: bool = True
    ctx_group: bool = True
    ctx_aware: bool = True
    placement: str = "pack"
    latency_tasks_num_upperbound: int = 4
    latency_tokens_num_upperbound: int | None = None
    tasks_capacity: int | None = None
    tokens_capacity: int | None = None
    max_queue_size: int = 1024
    ctx_min_tokens: int = 128
    client_rtt_s: float = 0.0

    def __post_init__(self):
        if self.mode not in PROGRAM_MODES:
            raise ValueError(f"unknown {self.mode=}; choose one of {PROGRAM_MODES}")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"unknown {self.placement=}; choose 'pack' or 'spread'")
        _check_positive(
            self,
            "latency_tasks_num_upperbound",
            "latency_tokens_num_upperbound",
            "tasks_capacity",
            "tokens_capacity",
            "max_queue_size",
            "ctx_min_tokens",
        )
        if not self.client_rtt_s >= 0:
            raise ValueError(f"client_rtt_s must be >= 0, got {self.client_rtt_s=}")

    def replace(self, **changes) -> ProgramConfig:
        return dataclasses.replace(self, **changes)


def parse_kernel_options(text: str) -> dict[str, int | bool]:
    """EngineConfig.kernel_options -> keyword arguments: 'num_stages=2,warp_specialized=true'
    -> {'num_stages': 2, 'warp_specialized': True} (integers, or true/false)."""
    options: dict[str, int | bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not key.isidentifier():
            raise ValueError(f"kernel_options: want key=value items, got {item!r} in {text!r}")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
            continue
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(
                f"kernel_options: {key}={value!r} is not an integer or true/false"
            ) from None
    return options


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is laid out over devices (llmjax/parallel/; ALGORITHMS.md §3 for PP).

    `tp`: tensor parallelism (Megatron): attention heads and the MLP hidden dimension split over
    `tp` devices, one all-reduce after attention and one after the MLP; KV pages split by KV head;
    embedding and LM head split over the vocabulary. tp must divide the model's heads, except that
    kv heads fewer than tp are repeated (each device keeps a copy of the kv head its query heads
    use, vLLM's replication), and `pad_heads=True` pads the kv heads (each with its group of query
    heads) to a multiple of tp with zero weights: exact outputs for more KV memory (SmolLM2's 3
    kv heads at tp=2 or 4: 4 heads, 33 % more).
    `pp`: pipeline stages (on disjoint device groups), each holding only its layers' weights and KV
    pages. `dp`: data-parallel replicas; must be 1 (run one engine per replica).
    `ep`: expert parallelism for a mixture of experts, within the tp devices (ep divides tp):
    the experts split into ep groups of E / ep whole experts, each group on tp / ep devices that
    split its experts' hidden dims (ep = tp: each device holds E / tp whole experts; ep = 1: every
    device holds a 1/tp slice of every expert). Attention and the rest stay tensor-parallel over
    all tp devices. Each device routes its share of the step's tokens, sends each (token, expert)
    pair to the devices of its expert's group and gets the result back (all-to-all,
    llmjax/model/moe.py), so a device computes only its own experts.
    `check_lockstep` (multi-host debugging): after every step each process compares a digest of
    the sampled tokens with the others' and raises on a difference.
    The mesh uses the first tp * pp devices of `jax.devices()` (all processes' devices after
    `jax.distributed.initialize`).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    pad_heads: bool = False
    check_lockstep: bool = False

    def __post_init__(self):
        _check_positive(self, "tp", "pp", "dp", "ep")
        if self.tp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide tp={self.tp}: expert parallelism splits the experts "
                "within the tensor-parallel devices (e.g. tp=8, ep=8 or ep=4)"
            )
        if self.dp != 1:
            raise ValueError(
                f"{self.dp=}: data-parallel replicas are not supported inside one engine; run "
                "one engine per replica"
            )

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`, names as vLLM spells them;
    llmjax/engine/speculative.py, docs/speculative.md).

    `method`:
      none    off (the default).
      ngram   prompt lookup: the proposals are the tokens that followed the latest earlier
              occurrence of the request's last n tokens in its own prompt and output, for the
              longest n in [`prompt_lookup_min`, `prompt_lookup_max`] that occurs (host only).
      draft   the target's own first `num_draft_layers` layers, its final norm and its LM head
              (early exit: no second checkpoint) propose greedily, one token per draft pass
              over the same KV pages (those layers' KV of the context is the target's); with
              all the layers the draft is the target (every proposal accepted: a check).
    Each decoding request proposes up to `num_speculative_tokens` (k) tokens; one step verifies
    them and samples one more (k + 1 rows of the request, like a short prefill chunk), so a
    request gains up to k + 1 tokens a step. Greedy rows keep the leading proposals equal to the
    target's argmax, so greedy output is the same as without speculation; sampled rows use
    rejection sampling (accept a proposal x with probability p(x), else sample p without x,
    renormalized: the target distribution, exactly, for point-mass proposals). The token
    budget counts the proposals; they never preempt (a request speculates only as far as the
    free pages and the budget left allow), and pages of rejected proposals are given back.
    A request stops speculating for `acceptance_window` decode steps when fewer than
    `min_acceptance_rate` of its last `acceptance_window` proposed tokens were accepted (then it
    tries again), and nobody speculates while more than `disable_by_batch_size` requests run
    (None: no bound; vLLM's). `adaptive`: each step verifies the proposals worth their cost:
    the engine measures what decode steps cost per (padded) token count and estimates each
    request's acceptance, and keeps the proposals that maximize expected tokens per second
    (the likeliest requests first, capped per request; `Speculator.select`); off: every
    proposal is verified. Requests with logits processing, logprobs or structured outputs
    decode one token a step beside the others' verifications; a step that computes prompt
    logprobs verifies nothing.
    """

    method: str = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    num_draft_layers: int = 4
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 32
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose one of {SPECULATIVE_METHODS}"
            )
        _check_positive(
            self,
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "num_draft_layers",
            "acceptance_window",
            "disable_by_batch_size",
        )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"{self.min_acceptance_rate=} must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @classmethod
    def coerce(cls, value) -> SpeculativeConfig:
        """A SpeculativeConfig from itself, None (off) or vLLM's dict
        (`{"method": "ngram", "num_speculative_tokens": 4, ...}`), naming unknown keys."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict or SpeculativeConfig: {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**value)


SPARSE_KV_MODES = ("none", "offload", "infinigen", "oracle", "quest", "h2o")
SELECTIVE_MODES = ("infinigen", "oracle", "quest", "h2o")  # decode steps attend to a selection
QUERY_SOURCES = ("previous_layer", "own_layer")  # InfiniGen's speculated query
PAGE_RESIDUALS = ("none", "page_mid", "page_upper")  # InfiniGen's cut columns, page-bounded
SPARSE_GRANULARITIES = ("token", "page")
POOL_MEMORIES = ("auto", "pinned_host", "device")
EVICTION_POLICIES = ("counter", "lru", "fifo")  # the host pool's (llmjax/sparse/host_pool.py)


@dataclasses.dataclass(frozen=True)
class SparseKVConfig:
    """Where the KV cache lives and which of it each layer reads (llmjax/sparse/; ALGORITHMS.md
    §11, InfiniGen).

    `mode`:
      none       the paged KV cache in device memory, full attention (the default).
      offload    the paged KV cache in a host-memory pool; every layer fetches all of each
                 sequence's pages to the device (FlexGen-style full offload, the baseline).
      infinigen  the same host pool; in decode-only steps, while layer i runs, the tokens layer
                 i+1 will attend to are predicted from layer i's attention input, a partial
                 query (the next layer's query skewed and cut to `partial_weight_ratio` of its
                 columns) and a device-resident partial key cache; only those tokens' KV is
                 fetched. Steps with prefill tokens and the first `num_dense_layers` layers
                 attend fully (fetching everything), as InfiniGen's prefill and layer 0 do.
      oracle     the same pool and steps, but each sparse layer selects by the exact attention
                 logits of its own query against every key: the best `max_num_kv` tokens (or
                 pages), an upper bound on any selection at that budget. It reads every key, so
                 it saves no bytes (the bytes reported are its selection's).
      quest      Quest (Tang et al., ICML'24): each page's element-wise key min and max are kept
                 on the device; a sparse layer scores a page by the upper bound sum over dims of
                 max(q * min, q * max) with its own query and fetches the best `max_num_kv` //
                 page_size pages (always page-granular; `alpha` unused).
      h2o        H2O (Zhang et al., NeurIPS'23): each token's attention received so far is
                 accumulated on the device; a decode step keeps the `max_num_kv` heavy hitters
                 (per kv head) and evicts the rest for good, where the other modes choose again
                 every step (llmjax/sparse/h2o.py; needs prefix caching off).
    InfiniGen's selection (per query token and kv head): tokens whose speculated logit is within
    `alpha` of the maximum (5 for Llama in InfiniGen; inf: always fill the cap); the count is
    averaged over kv heads and capped at `max_num_kv` (None: no cap).
    InfiniGen's variants (each measured against the others by scripts/eval_sparse.py):
    `query_source` 'previous_layer' (InfiniGen: layer i's attention input predicts layer i+1's
    query, so the fetch overlaps layer i) or 'own_layer' (each sparse layer scores with its own
    query against its partial keys and fetches after: the same partial keys with the cross-layer
    prediction taken out, and no overlap; a diagnostic). `page_residual` adds to each token's
    partial score an estimate of the skewed columns the cut left out, from Quest-style bounds:
    each page's element-wise min and max of its keys in those columns, kept on the device
    ([num_pages, 2, K, H - c] float32, 2 / page_size of those columns' rows); 'page_mid' adds
    the midpoint of the interval [sum min(q*lo, q*hi), sum max(q*lo, q*hi)] over the left-out
    columns, 'page_upper' its upper end (Quest's bound), 'none' nothing (InfiniGen).
    Every selective mode always fetches the first `num_sink_tokens` and the last
    `num_recent_tokens` (the new token included) besides, and leaves the first
    `num_dense_layers` layers dense. `granularity` 'token' gathers single
    tokens through the page table; 'page' scores a page by its best token and fetches whole
    pages (`max_num_kv` // page_size of them).
    `pool_memory`: 'pinned_host' (a JAX host memory kind, gathers run on the host via
    `compute_on`), 'device' (the pool in device memory: the same algorithm, for comparing), 'auto'
    (pinned_host where the backend has it).
    `capacity` (InfiniGen's pool bound, 1.0 = unlimited; 0.8 in its eviction study): a request
    keeps at most this fraction of its pages, evicting by `eviction` ('counter': fewest
    selections, InfiniGen's; 'lru'; 'fifo') among its older half; prefix-cached pages shared with
    other requests are never evicted (llmjax/sparse/host_pool.py).
    `skew_dir`: a directory for infinigen_skew.npz (llmjax/sparse/skew.py), e.g. beside the
    checkpoint: `LLM` reads it, or calibrates on a bundled public-domain text and writes it
    there; None calibrates at every start-up and keeps the matrices in memory.
    The host pool path (`compute_on('device_host')` gathers and writes) has been compiled and
    tested on the CPU backend only; on a GPU or TPU, `pool_memory='device'` runs the same
    algorithm with the pool in device memory if the host path does not compile there.
    """

    mode: str = "none"
    alpha: float = 5.0
    partial_weight_ratio: float = 0.2
    max_num_kv: int | None = 400
    num_sink_tokens: int = 1
    num_recent_tokens: int = 16
    num_dense_layers: int = 2
    granularity: str = "token"
    pool_memory: str = "auto"
    capacity: float = 1.0
    eviction: str = "counter"
    skew_dir: str | None = None
    query_source: str = "previous_layer"
    page_residual: str = "none"

    def __post_init__(self):
        if self.mode not in SPARSE_KV_MODES:
            raise ValueError(
                f"unknown sparse_kv mode {self.mode!r}; choose one of {SPARSE_KV_MODES}"
            )
        if self.granularity not in SPARSE_GRANULARITIES:
            raise ValueError(f"unknown {self.granularity=}; choose one of {SPARSE_GRANULARITIES}")
        if self.pool_memory not in POOL_MEMORIES:
            raise ValueError(f"unknown {self.pool_memory=}; choose one of {POOL_MEMORIES}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown {self.eviction=}; choose one of {EVICTION_POLICIES}")
        if self.query_source not in QUERY_SOURCES:
            raise ValueError(f"unknown {self.query_source=}; choose one of {QUERY_SOURCES}")
        if self.page_residual not in PAGE_RESIDUALS:
            raise ValueError(f"unknown {self.page_residual=}; choose one of {PAGE_RESIDUALS}")
        _check_positive(self, "max_num_kv", "num_dense_layers")
        if not 0 < self.partial_weight_ratio <= 1:
            raise ValueError(f"{self.partial_weight_ratio=} must be in (0, 1]")
        if not 0 < self.capacity <= 1:
            raise ValueError(f"{self.capacity=} must be in (0, 1]")
        if self.alpha < 0:
            raise ValueError(f"{self.alpha=} must be >= 0")
        if self.num_sink_tokens < 0 or self.num_recent_tokens < 1:
            raise ValueError(
                f"{self.num_sink_tokens=} must be >= 0 and {self.num_recent_tokens=} >= 1 (the "
                "new token attends to itself)"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def selective(self) -> bool:
        """Decode-only steps attend to a selection of the KV (infinigen, oracle, quest, h2o)."""
        return self.mode in SELECTIVE_MODES

    @property
    def selection(self) -> str:
        """The selection's name in tables and plots: the mode, with InfiniGen's variants
        appended ('infinigen+own+mid': query_source own_layer, page_residual page_mid)."""
        name = self.mode
        if self.mode == "infinigen":
            if self.query_source == "own_layer":
                name += "+own"
            if self.page_residual != "none":
                name += "+" + self.page_residual.removeprefix("page_")
        return name

    @property
    def selects_in_layer(self) -> bool:
        """Each sparse layer selects with its own query or state after its key write (oracle,
        quest, h2o; infinigen with query_source='own_layer'), rather than one layer ahead."""
        return self.mode in ("oracle", "quest", "h2o") or (
            self.mode == "infinigen" and self.query_source == "own_layer"
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights.

    `dtype` is the compute and storage dtype of weights and KV cache. float32 is the CPU default:
    bf16 matrix-vector products run about 20x slower than f32 on x86 CPUs at small batch.
    `quantization` (QUANTIZATIONS; llmjax/model/quant.py): 'none'; 'int8', W8A8 dynamic (weights
    int8 per output channel, activations int8 per token at run time, int32 accumulation; norms,
    biases and an untied embedding stay in `dtype`; the float weights SmoothQuant-smoothed at
    load unless `LLM(smoothquant=None)`, llmjax/model/smooth.py; the LM head weight-only);
    'int8_wo', weight-only int8 (the same
    per-channel weights, activations kept in `dtype`, float32 sums); 'q8_0', 'q4_0', 'q4_1',
    the float weights quantized into those GGUF block formats as llama.cpp does; 'gguf', a GGUF
    checkpoint's Q8_0 / Q4_0 / Q4_1 tensors kept in their blocks as stored (the rest loaded in
    `dtype`). Activations and the KV cache stay in `dtype`.
    `max_model_len` (prompt + generated tokens per request) defaults to the model's
    `max_position_embeddings`. `attention_backend` (ATTENTION_BACKENDS): 'reference' (plain jnp,
    llmjax/model/attention.py), 'pallas' (the ragged paged attention kernels of kernels_pallas/:
    compiled on GPU/TPU, interpret mode on the CPU, slow, for checking), 'cpu' (kernels_cpu/'s C++
    ragged paged attention, built at first use with the system compiler; CPU only) or 'auto'
    (pallas on GPU/TPU; on the CPU, cpu where its kernels build, else reference).
    `flash_prefill` (pallas backend only): a step whose batch is
    one fresh prompt (one sequence, nothing cached) attends with the flash prefill kernel instead
    of the ragged one: 'auto' where it was measured faster (token buckets from
    kernels_pallas/flash_prefill/tuning.py ENGINE_MIN_TOKENS: GPU >= 2048 with either kernel,
    TPU never), 'on' in every bucket (for checking and measuring), 'off' never. `pallas_kernel`
    (PALLAS_KERNELS, pallas backend only): which kernels (ragged paged attention and flash
    prefill), 'auto' the platform's (gpu on CUDA, tpu on TPU and, interpreted, on the CPU), or by
    name: 'tpu' (Mosaic TPU), 'gpu' (Triton), 'mgpu' (Mosaic GPU for Hopper: bfloat16/float16,
    head_dim % 64 == 0 (flash prefill: and <= 256), page_size % 8 == 0; interpreted on the CPU).
    `kernel_options` (with a named `pallas_kernel`): keyword arguments of that ragged paged
    attention kernel function, 'key=value,...' (integers or true/false; e.g. 'num_stages=2' or
    'warp_specialized=true,num_consumers=2' for mgpu; see kernels_pallas/ragged_paged_attention/
    kernel_*.py), to compare kernel variants and block sizes inside the engine; checked against
    the function's signature when the engine is built.
    `layer_loop` (LAYER_LOOPS): how the step runs the decoder layers: 'scan' (`lax.scan` over
    weights stacked [L, ...] and one KV cache of every layer's pages, [L * num_pages, ...]: one
    layer is compiled, so compile time does not grow with depth; a SmolLM2 decode bucket compiles
    in 1.0 s instead of 3.6-4.4 s on a 2-core CPU, and runs as fast), 'unroll' (a
    Python loop over a list of layers: L copies of the layer in the program, one named scope each
    in profiles) or 'auto': scan, except on GPUs (unrolled decode steps at batch 32 were 2.5x
    faster on an H200; UNROLL_BY_DEFAULT) and with sparse_kv, whose step treats layers one by one
    (InfiniGen speculates layer i + 1 during layer i). Both give the same numbers. With pp > 1
    each stage scans over its own layers.
    `compilation_cache_dir`
    enables JAX's persistent compilation cache ('' disables it). `sparse_kv` (SparseKVConfig): the
    KV cache in host memory with full or InfiniGen-selected fetches ('none' by default). `kv_store`
    (KVStoreConfig): host, disk and Mooncake tiers below the device pages (off by default).
    `speculative` (SpeculativeConfig): speculative decoding, ngram or early-exit draft (off by
    default; one device or tp, dense KV, a real device).
    `precompile` compiles every step shape at start (|token buckets| x |page buckets| variants;
    with pp > 1 the pipeline tick of each, and the carry's resizes) so that serving never
    compiles; off by default because on a CPU that takes minutes for a real model the first time
    (later starts load the persistent cache). `compile_ahead` compiles, in a background
    thread, the step shapes the next steps are likely to meet (the next page bucket of the
    batch's contexts, the decode-only batch of the running requests: `Buckets.likely_next`), so
    that a cold start overlaps compilation with running steps instead of stopping for each new
    bucket (one device, one process; not with sparse_kv or pp > 1). Off by default: on this
    2-CPU machine the background compile takes a CPU from the running steps and a guess can be
    wasted (16 x (128+128), empty cache: 8.6 s with it, 8.4 s without); turn it on where the
    host has CPUs to spare (a GPU/TPU host).
    `token_buckets_per_octave`: the token counts a step is padded to (llmjax/engine/batch.py
    `token_buckets`): the powers of two and evenly spaced steps between them (multiples of 8),
    this many per octave. 1 is powers of two alone, which pays up to 100 % padding (16 decodes
    beside a 128-token chunk run as 256 tokens); 4, the default, at most 25 % (that step runs as
    160) for 23 token buckets instead of 10 at a 512-token budget, each compiled when first met.
    `device` (DEVICES): 'jax', the real device; 'sim', a simulated one (llmjax/sim/: the step's
    duration from `sim`'s cost model on the engine's virtual clock, no JAX).
    `async_scheduling` (vLLM's name): the host schedules and packs step N + 1 while the device
    runs step N (llmjax/engine/overlap.py); a running decode's newest token, not yet on the
    host, is taken from step N's output on the device. True, False, or None for the
    backend's default (`async_scheduling_on`; ASYNC_BY_DEFAULT). Outputs are the same either
    way. Engines with speculative decoding, pp > 1, sparse_kv, KV tiers or the prefill role
    run synchronously; a step whose in-flight predecessor holds a request with structured
    outputs or penalties (their next step needs the token on the host) waits for it.
    """

    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    sparse_kv: SparseKVConfig = SparseKVConfig()
    kv_store: KVStoreConfig = KVStoreConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    dtype: str = "float32"
    quantization: str = "none"
    max_model_len: int | None = None
    attention_backend: str = "auto"
    flash_prefill: str = "auto"
    pallas_kernel: str = "auto"
    kernel_options: str = ""
    layer_loop: str = "auto"
    seed: int = 0
    precompile: bool = False
    compile_ahead: bool = False
    async_scheduling: bool | None = None
    token_buckets_per_octave: int = 4
    device: str = "jax"
    sim: object | None = None
    compilation_cache_dir: str = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmjax", "jax"
    )

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"unknown {self.device=}; choose one of {DEVICES}")
        if (self.device == "sim") != (self.sim is not None):
            raise ValueError("device='sim' and a SimConfig (`sim`, llmjax/sim/) go together")
        if self.device == "jax" and self.model.architecture in SIM_ONLY_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.model.architecture!r} ({self.model.name or 'this model'}) "
                "is a shape for the simulated device only: use device='sim'"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported {self.dtype=}; choose one of {DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown {self.quantization=}; choose one of {QUANTIZATIONS}")
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.model.max_position_embeddings)
        _check_positive(self, "max_model_len")
        sched = self.scheduler
        if not sched.chunks_prefills and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"policy {sched.policy!r} runs whole prompts, so max_num_batched_tokens="
                f"{sched.max_num_batched_tokens} must be >= max_model_len={self.max_model_len}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown {self.attention_backend=}; choose one of {ATTENTION_BACKENDS}"
            )
        if self.flash_prefill not in FLASH_PREFILL_MODES:
            raise ValueError(f"unknown {self.flash_prefill=}; choose one of {FLASH_PREFILL_MODES}")
        if self.pallas_kernel not in PALLAS_KERNELS:
            raise ValueError(f"unknown {self.pallas_kernel=}; choose one of {PALLAS_KERNELS}")
        if parse_kernel_options(self.kernel_options) and self.pallas_kernel == "auto":
            raise ValueError(
                f"kernel_options={self.kernel_options!r} are one kernel's arguments: name the "
                "kernel with pallas_kernel ('tpu', 'gpu' or 'mgpu')"
            )
        if self.pallas_kernel == "mgpu":
            from kernels_pallas.ragged_paged_attention.kernel_mgpu import check_supported

            m = self.model
            check_supported(
                self.dtype, m.head_dim, self.cache.page_size, m.num_heads // m.num_kv_heads
            )
            if self.flash_prefill != "off":
                from kernels_pallas.flash_prefill.kernel_mgpu import (
                    check_supported as check_flash_supported,
                )

                check_flash_supported(self.dtype, m.head_dim)
        from llmjax.parallel.heads import tp_head_layout

        tp_head_layout(self.model, self.parallel.tp, self.parallel.pad_heads)  # raises if invalid
        if self.sparse_kv.enabled:
            if self.parallel.num_devices > 1:
                raise ValueError(
                    f"sparse_kv={self.sparse_kv.mode!r} runs on one device; got tp="
                    f"{self.parallel.tp} pp={self.parallel.pp}"
                )
            if self.sparse_kv.num_dense_layers > self.model.num_layers:
                raise ValueError(
                    f"sparse_kv.num_dense_layers={self.sparse_kv.num_dense_layers} exceeds the "
                    f"model's {self.model.num_layers} layers"
                )
            if self.sparse_kv.mode == "h2o" and self.cache.prefix_cache != "none":
                raise ValueError(
                    "sparse_kv='h2o' evicts tokens from the pages a request owns, so its pages "
                    f"cannot be shared: set prefix_cache='none' (got {self.cache.prefix_cache!r})"
                )
        if not (
            isinstance(self.token_buckets_per_octave, int) and self.token_buckets_per_octave >= 1
        ):
            raise ValueError(f"{self.token_buckets_per_octave=} must be an integer >= 1")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"unknown {self.layer_loop=}; choose one of {LAYER_LOOPS}")
        if self.layer_loop == "scan" and self.sparse_kv.enabled:
            raise ValueError(
                f"layer_loop='scan' does not run with sparse_kv={self.sparse_kv.mode!r}, whose "
                "step treats layers one by one: use 'auto' or 'unroll'"
            )
        if self.parallel.pp > self.model.num_layers:
            raise ValueError(
                f"pp={self.parallel.pp} stages need at least as many layers, the model has "
                f"{self.model.num_layers}"
            )
        ep = self.parallel.ep
        if ep > 1 and not self.model.is_moe:
            raise ValueError(f"ep={ep} splits a mixture of experts; this model has no experts")
        if ep > 1 and self.model.num_experts % ep:
            raise ValueError(
                f"ep={ep} must divide the model's {self.model.num_experts} experts (each device "
                "group holds num_experts / ep whole experts)"
            )
        spec = self.speculative
        if spec.enabled:
            why = []
            if self.parallel.pp > 1:
                why.append(f"pp == 1 (got {self.parallel.pp})")
            if self.sparse_kv.enabled:
                why.append(f"sparse_kv='none' (got {self.sparse_kv.mode!r})")
            if self.device != "jax":
                why.append("a real device (the simulator computes no logits to verify)")
            if why:
                raise ValueError("speculative decoding needs " + ", ".join(why))
            if spec.method == "draft" and spec.num_draft_layers > self.model.num_layers:
                raise ValueError(
                    f"speculative num_draft_layers={spec.num_draft_layers} exceeds the model's "
                    f"{self.model.num_layers} layers"
                )
        kv = self.kv_store
        if kv.enabled:
            if kv.block_size % self.cache.page_size:
                raise ValueError(
                    f"kv_store.block_size={kv.block_size} must be a multiple of the page size "
                    f"{self.cache.page_size}"
                )
            why = []
            if self.cache.prefix_cache != "radix":
                why.append(f"prefix_cache='radix' (got {self.cache.prefix_cache!r})")
            if self.parallel.pp > 1:
                why.append(f"pp == 1 (got {self.parallel.pp})")
            if self.sparse_kv.enabled:
                why.append(f"sparse_kv='none' (got {self.sparse_kv.mode!r})")
            if self.device != "jax":
                why.append("a real device (the simulator does not model KV tiers)")
            if why:
                raise ValueError("the KV tiers (kv_store) need " + ", ".join(why))

    def async_scheduling_on(self, platform: str | None = None) -> bool:
        """`async_scheduling` resolved: None is on where the platform (default: JAX's default
        backend; the simulator's 'sim') is in ASYNC_BY_DEFAULT."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if platform is None:
            if self.device == "sim":
                platform = "sim"
            else:
                import jax

                platform = jax.default_backend()
        return platform in ASYNC_BY_DEFAULT

    @property
    def scans_layers(self) -> bool:
        """Whether the step scans over stacked layers (`layer_loop` resolved)."""
        return layer_loop_scans(self.layer_loop, self.sparse_kv.enabled)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# Platforms whose 'auto' layer loop is unrolled: on one H200 (2026-12-04, SmolLM2 shapes, bf16,
# scripts/bench_decode.py in scripts/device_check.sh) a decode step at batch 32 took 4.26 ms
# unrolled against 10.60 ms scanned (batch 1: 3.36 against 2.41; compile 6.9 s against 1.8 s).
UNROLL_BY_DEFAULT = ("gpu", "cuda", "rocm")
# Platforms where `EngineConfig.async_scheduling` None means on (measured: docs/engine.md, "The
# engine step, and async scheduling"; scripts/bench_async.py).
ASYNC_BY_DEFAULT: tuple[str, ...] = ()


def layer_loop_scans(layer_loop: str, sparse_kv: bool, platform: str | None = None) -> bool:
    """`EngineConfig.layer_loop` resolved: True for 'scan'; for 'auto', True unless a sparse KV
    mode is on or `platform` (default: JAX's default backend) is a GPU (UNROLL_BY_DEFAULT)."""
    if layer_loop != "auto":
        return layer_loop == "scan"
    if sparse_kv:
        return False
    if platform is None:
        import jax

        platform = jax.default_backend()
    return platform not in UNROLL_BY_DEFAULT


# Fields an override may not change: the loaded weights were read and placed for them.
FIXED_BY_WEIGHTS = (
    "model",
    "dtype",
    "quantization",
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.pad_heads",
    "device",
    "sim",
)


def apply_overrides(config, overrides: Mapping[str, Any]):
    """`config` (a frozen config dataclass) with nested fields replaced by dotted path, each level
    re-validated. A string value is parsed by the field's type (what command-line flags give:
    ints, floats, booleans as true/false, 'none', comma-separated tuples); other values are used
    as they are. Paths in FIXED_BY_WEIGHTS are refused (EngineConfig).

        apply_overrides(engine_config, {"scheduler.lpm_max_queue_len": "64",
                                        "cache.watermark": 0.02})
    """
    for path, value in overrides.items():
        if isinstance(config, EngineConfig) and any(
            path == f or path.startswith(f + ".") for f in FIXED_BY_WEIGHTS
        ):
            raise ValueError(f"{path!r} is fixed by the loaded weights; it cannot be overridden")
        config = _replace_path(config, path.split("."), value, path)
    return config


def read_override(cls: type, path: str, value):
    """An override's value as the field at dotted `path` of the config dataclass `cls` holds it
    (a string parsed by the field's type, as `apply_overrides` does; other values unchanged)."""
    hint = cls
    for name in path.split("."):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            raise ValueError(f"{path!r}: {getattr(hint, '__name__', hint)} has no fields")
        hints = typing.get_type_hints(hint)
        if name not in hints:
            raise ValueError(f"{path!r}: {hint.__name__} has no field {name!r}")
        hint = hints[name]
    if not isinstance(value, str):
        return value
    try:
        return _parse_value(value, hint)
    except ValueError as e:
        raise ValueError(f"{path!r}: cannot read {value!r} as {hint}: {e}") from None


def _replace_path(obj, names: list[str], value, path: str):
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"{path!r}: {type(obj).__name__} has no fields")
    fields = {f.name for f in dataclasses.fields(obj)}
    name = names[0]
    if name not in fields:
        raise ValueError(
            f"{path!r}: {type(obj).__name__} has no field {name!r}; fields: {sorted(fields)}"
        )
    if len(names) > 1:
        value = _replace_path(getattr(obj, name), names[1:], value, path)
    elif isinstance(value, str):
        hint = typing.get_type_hints(type(obj))[name]
        try:
            value = _parse_value(value, hint)
        except ValueError as e:
            raise ValueError(f"{path!r}: cannot read {value!r} as {hint}: {e}") from None
    return dataclasses.replace(obj, **{name: value})


def _parse_value(text: str, hint):
    """A command-line string -> a value of type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() == "none" and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _parse_value(text, arg)
                except ValueError:
                    continue
        raise ValueError("no member of the union accepts it")
    if origin is Literal:
        if text in args:
            return text
        raise ValueError(f"choose one of {args}")
    if origin is tuple:
        item = args[0] if args else str
        return tuple(_parse_value(x.strip(), item) for x in text.split(",") if x.strip())
    if hint is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError("want true or false")
    if hint in (int, float, str):
        return hint(text)
    raise ValueError("not settable from a string; pass the value itself")
