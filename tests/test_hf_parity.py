"""Our model against HF transformers on the same weights (golden files from
scripts/golden/make_model_golden.py): every position's logits, and greedy decoding through the
engine. One tiny checkpoint per architecture llmjax runs (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3, Mixtral, Qwen2-MoE, Qwen3-MoE), and variants (tied, llama3 RoPE, sharded)."""

import os

import numpy as np
import pytest

from llmjax.checkpoint import load_hf
from llmjax.model.params import stack_layers
from tests.conftest import TESTDATA
from tests.helpers import full_logits

CHECKPOINTS = [
    "llama",
    "llama_tied",
    "llama3_rope",
    "qwen2",
    "mistral",
    "llama_sharded",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
]
# Families whose layers differ (local and global): their logits are checked with the layers
# scanned too (the per-layer table traced, the window picked by lax.switch).
MIXED_LAYERS = ["gemma2", "gemma3"]


def _golden(name):
    path = os.path.join(TESTDATA, "hf_tiny", name)
    return path, np.load(os.path.join(path, "golden.npz"))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_hf(name):
    path, golden = _golden(name)
    config, params = load_hf(path)
    scanned = [*MIXED_LAYERS, "qwen3", "qwen2_moe"]  # and stacked experts [L, E, ...]
    layouts = [params, stack_layers(params)] if name in scanned else [params]
    for p in layouts:
        rows = zip(golden["input_ids"], golden["lengths"], golden["logits"], strict=True)
        for ids, n, want in rows:
            got = full_logits(p, config, ids[:n].tolist(), page_size=8)
            scale = np.abs(want[:n]).max()
            np.testing.assert_allclose(got, want[:n], rtol=1e-4, atol=1e-4 * scale)


def test_architecture_table_read_from_hf_configs():
    from llmjax.config import ModelConfig

    qwen3 = ModelConfig.from_hf_config(os.path.join(TESTDATA, "hf_tiny", "qwen3"))
    assert qwen3.qk_norm and not qwen3.norm_plus_one and qwen3.head_dim == 32
    assert qwen3.layer_types is None and qwen3.sliding_window is None
    gemma2 = ModelConfig.from_hf_config(os.path.join(TESTDATA, "hf_tiny", "gemma2"))
    assert gemma2.norm_plus_one and gemma2.post_norms and gemma2.scale_embeddings
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (5.0, 8.0)
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.attn_scale == 24**-0.5
    assert [gemma2.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert len(gemma2.attention_kinds) == 2 and gemma2.layer_kind_ids == (0, 1, 0, 1)
    gemma3 = ModelConfig.from_hf_config(os.path.join(TESTDATA, "hf_tiny", "gemma3"))
    assert gemma3.qk_norm and gemma3.rope_local_base_freq == 1000.0
    assert gemma3.layer_kind_ids == (0, 0, 1, 0)
    local, full = gemma3.attention_kinds
    assert (local.window, local.rope_theta, local.rope_scaling) == (8, 1000.0, None)
    assert (full.window, full.rope_theta, full.rope_scaling.factor) == (None, 1e5, 4.0)
    mixtral = ModelConfig.from_hf_config(os.path.join(TESTDATA, "hf_tiny", "mixtral"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        8,
        2,
        True,
    )
    assert mixtral.expert_intermediate_size == 64 and not mixtral.shared_expert_intermediate_size
    qwen2_moe = ModelConfig.from_hf_config(os.path.join(TESTDATA, "hf_tiny", "qwen2_moe"))
    assert qwen2_moe.attention_bias and not qwen2_moe.norm_topk_prob
    assert (qwen2_moe.expert_intermediate_size, qwen2_moe.shared_expert_intermediate_size) == (
        32,
        96,
    )
    qwen3_moe = ModelConfig.from_hf_config(os.path.join(TESTDATA, "hf_tiny", "qwen3_moe"))
    assert qwen3_moe.qk_norm and qwen3_moe.norm_topk_prob and qwen3_moe.num_experts_per_tok == 3


@pytest.mark.parametrize(
    "hf, want",
    [
        # An older Gemma 2 config: no layer_types (alternating from layer 0), HF's defaults.
        (
            {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096},
            dict(
                layer_types=("sliding_attention", "full_attention") * 2,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                query_pre_attn_scalar=256.0,
                head_dim=256,
                tie_word_embeddings=True,
                hidden_act="gelu_pytorch_tanh",
            ),
        ),
        # An older Gemma 3 config: sliding_window_pattern, rope_local_base_freq, rope_scaling.
        (
            {
                "model_type": "gemma3_text",
                "num_hidden_layers": 8,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "rope_theta": 1e6,
                "rope_local_base_freq": 1e4,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            },
            dict(
                layer_types=("sliding_attention",) * 5
                + ("full_attention",)
                + ("sliding_attention",) * 2,
                rope_theta=1e6,
                rope_local_base_freq=1e4,
                attn_logit_softcapping=None,
                qk_norm=True,
            ),
        ),
        # Gemma 3's multimodal config: the text decoder's config nested under text_config.
        (
            {
                "model_type": "gemma3",
                "text_config": {"num_hidden_layers": 6, "sliding_window": 512},
            },
            dict(layer_types=("sliding_attention",) * 5 + ("full_attention",), sliding_window=512),
        ),
        # Qwen3 with use_sliding_window false: layer_types name no sliding layer.
        (
            {"model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 4096},
            dict(layer_types=None, sliding_window=None, qk_norm=True, attention_bias=False),
        ),
    ],
)
def test_hf_config_variants(hf, want):
    from llmjax.config import ModelConfig

    shape = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if "text_config" in hf:
        hf = {**hf, "text_config": {**shape, **hf["text_config"]}}
    else:
        hf = {**shape, **hf}
    config = ModelConfig.from_hf_config(hf)
    for field, value in want.items():
        assert getattr(config, field) == value, field
    if want.get("rope_scaling") is None and "rope_theta" in want:
        kinds = config.attention_kinds
        assert kinds[0].rope_theta == 1e4 and kinds[0].rope_scaling is None
        assert kinds[1].rope_theta == 1e6 and kinds[1].rope_scaling.factor == 8.0


def test_bad_architecture_table_entries():
    from llmjax.config import ModelConfig

    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                num_kv_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig(**base, hidden_act="relu")
    with pytest.raises(ValueError, match="no sliding_window"):
        ModelConfig(**base, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="layer_types for"):
        ModelConfig(**base, sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="unknown layer_types"):
        ModelConfig(**base, sliding_window=4, layer_types=("local", "global"))
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_hf_config(
            {"model_type": "gemma3_text", "use_bidirectional_attention": True}
        )


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_decoding_matches_hf(name):
    """Through the engine: chunked prefill (16-token chunks), 4-token pages, scanned layers.
    Gemma 2/3's are in tests/test_architectures.py, in a mixed batch."""
    from llmjax import LLM, SamplingParams

    path, golden = _golden(name)
    n = golden["lengths"][0]
    prompt = golden["input_ids"][0][:n].tolist()
    llm = LLM(path, page_size=4, max_num_batched_tokens=16, compilation_cache_dir="")
    params = SamplingParams(max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == golden["greedy_ids"].tolist()
