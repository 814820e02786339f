"""The shape of a decoder (`ModelConfig`, from an HF config.json here; from a GGUF file in
llmjax/checkpoint/gguf.py) and the dtypes weights and KV cache are kept in."""

from __future__ import annotations

import dataclasses
import json
import os
import typing

from llmjax.config.checks import _check_positive
from llmjax.config.families import (
    FAMILY_TRAITS,
    HF_DEFAULTS,
    HF_MODEL_TYPES,
    HIDDEN_ACTS,
    LAYER_TYPES,
    MOE_ARCHITECTURES,
    SIM_ONLY_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
)
from llmjax.config.rope import RopeScaling

DTYPES = ("float32", "bfloat16", "float16")


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
