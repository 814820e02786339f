"""HF export (`llmjax.checkpoint.hf.save_hf`, `convert_checkpoint.py --format hf`): what is written
reads back through load_model / load_hf with the same config and exactly the same weights, the
tensors are HF's (the tiny HF checkpoints come back byte for byte), the tokenizer encodes as the
GGUF's, and, where transformers is installed, transformers runs it to the same logits."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import configs
from llmjax.checkpoint import load_hf, load_model
from llmjax.checkpoint.hf import hf_config_dict, save_hf
from llmjax.config import ModelConfig, RopeScaling
from llmjax.model.params import init_params, stack_layers
from tests.conftest import TESTDATA
from tests.helpers import full_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_TINY = os.path.join(TESTDATA, "hf_tiny")

TINY_CONFIGS = {
    "llama": configs.TINY,
    "qwen3": configs.TINY_QWEN3,
    "gemma2": configs.TINY_GEMMA2,
    "gemma3": configs.TINY_GEMMA3,
    "llama_tied_mqa": configs.TINY_GQA1,
    "llama3_rope": configs.TINY.replace(
        rope_scaling=RopeScaling(
            rope_type="llama3", factor=8.0, original_max_position_embeddings=64
        ),
        eos_token_ids=(2, 3),
    ),
    "linear_rope": configs.TINY.replace(
        rope_scaling=RopeScaling(rope_type="linear", factor=2.0), bos_token_id=None
    ),
    "qwen2": configs.TINY.replace(architecture="qwen2", attention_bias=True),
    "mistral": configs.TINY.replace(architecture="mistral", sliding_window=8),
    "head_dim_64": configs.TINY_H64,
}

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "héllo wörld: naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽 and ∑∫√",
    "def f(x):\n\treturn x ** 2  # tabs, spaces   and\n\nnewlines\r\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Qu'est-ce que c'est? 🙂"},
    {"role": "assistant", "content": "Rien."},
    {"role": "user", "content": "Merci"},
]


def _assert_same_tree(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = _leaf(want, path)
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key if hasattr(key, "key") else key.idx]
    return tree


def _random_params(config, dtype=np.float32):
    params = init_params(config, jax.random.key(1))
    return jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_round_trip_same_params_and_logits(name, tmp_path):
    config = TINY_CONFIGS[name]
    params = _random_params(config)
    out = save_hf(tmp_path / "hf", config, params)
    got_config, got, kind = load_model(str(out))
    assert kind == "hf"
    assert got_config == config
    _assert_same_tree(got, params)
    ids = [5, 17, 3, 200, 9, 9, 41, 128, 1, 77, 30]
    np.testing.assert_array_equal(
        full_logits(got, got_config, ids), full_logits(params, config, ids)
    )


def test_stacked_jax_params_and_bfloat16(tmp_path):
    """LLM.params' layout (layers stacked, jax arrays) is accepted; bfloat16 is stored as BF16."""
    import jax.numpy as jnp

    config = configs.TINY
    params = jax.tree.map(jnp.asarray, _random_params(config))
    save_hf(tmp_path, config, stack_layers(params), dtype="bfloat16")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == jnp.bfloat16
    _, got = load_hf(tmp_path)
    rounded = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)).astype(np.float32), params)
    _assert_same_tree(got, rounded)


@pytest.mark.parametrize(
    "name", ["llama", "llama_tied", "llama3_rope", "qwen2", "mistral", "qwen3", "gemma2", "gemma3"]
)
def test_hf_checkpoints_come_back_byte_for_byte(name, tmp_path):
    """transformers-written checkpoints, loaded and exported again: the same tensor names,
    shapes, dtypes and bytes (so the layouts are HF's), and a config that reads back equal."""
    from safetensors.numpy import load_file

    src = os.path.join(HF_TINY, name)
    config, params = load_hf(src)
    save_hf(tmp_path, config, params)
    want = load_file(os.path.join(src, "model.safetensors"))
    got = load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert ModelConfig.from_hf_config(str(tmp_path)) == config


def test_config_fields():
    d = hf_config_dict(configs.TINY_GQA1, "bfloat16")
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    want = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    want |= dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_scaling=None)
    want |= dict(tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)
    want |= dict(torch_dtype="bfloat16", max_position_embeddings=512, rope_theta=10000.0)
    assert {k: d[k] for k in want} == want
    qwen = hf_config_dict(TINY_CONFIGS["qwen2"])
    assert qwen["architectures"] == ["Qwen2ForCausalLM"] and qwen["model_type"] == "qwen2"
    assert qwen["use_sliding_window"] is False
    with pytest.raises(ValueError, match="sliding window"):
        hf_config_dict(configs.TINY.replace(sliding_window=8))


def test_gguf_rope_freq_factors_are_written_as_llama3():
    """A Llama 3.1 GGUF's per-frequency divisors become the llama3 parameters they came from."""
    from llmjax.model.layers import rope_inv_freq

    llama3 = RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    config = configs.TINY.replace(head_dim=128, hidden_size=512, rope_theta=500000.0)
    base = rope_inv_freq(128, config.rope_theta, None).astype(np.float64)
    factors = base / rope_inv_freq(128, config.rope_theta, llama3)
    scaling = RopeScaling(rope_type="freq_factors", factor=factors.max(), freq_factors=factors)
    d = hf_config_dict(config.replace(rope_scaling=scaling))
    assert d["rope_scaling"] == {"rope_type": "llama3", **dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )}  # fmt: skip
    odd = dataclasses.replace(scaling, freq_factors=tuple(factors * 1.1))
    with pytest.raises(ValueError, match="match no llama3"):
        hf_config_dict(config.replace(rope_scaling=odd))


def test_convert_script_writes_hf(tmp_path):
    src = os.path.join(HF_TINY, "qwen2")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "convert_checkpoint.py")]
    cmd += [f"--model={src}", f"--out={out}", "--format=hf", "--dtype=float16"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    assert "(hf)" in res.stdout and "no tokenizer" in res.stdout
    config, params = load_hf(out)
    want_config, want = load_hf(src, dtype=np.float16)
    assert config == want_config
    _assert_same_tree(jax.tree.map(lambda x: x.astype(np.float16), params), want)


# ---- the real SmolLM2 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path, tmp_path_factory):
    """SmolLM2's GGUF exported as HF (config, GGUF params, directory)."""
    config, params, _ = load_model(smollm2_path)
    out = tmp_path_factory.mktemp("smollm2_hf")
    save_hf(out, config, params, tokenizer_source=smollm2_path)
    return config, params, str(out)


def test_smollm2_export_reloads_to_the_gguf_logits(smollm2_hf):
    config, params, out = smollm2_hf
    got_config, got, kind = load_model(out)
    assert kind == "hf" and got_config == config
    _assert_same_tree(got, params)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]
    np.testing.assert_array_equal(
        full_logits(got, got_config, ids), full_logits(params, config, ids)
    )


def test_smollm2_tokenizer_json_encodes_as_the_gguf(smollm2_hf, smollm2_path):
    from tokenizers import Tokenizer as Backend

    from llmjax.tokenizer import Tokenizer

    _, _, out = smollm2_hf
    gguf = Tokenizer.from_gguf(smollm2_path)
    chat = gguf.apply_chat_template(CHAT)
    backend = Backend.from_file(os.path.join(out, "tokenizer.json"))
    ours = Tokenizer.from_hf_dir(out)
    for text in [*TEXTS, chat]:
        want = gguf.encode(text)
        assert backend.encode(text).ids == want, text
        assert ours.encode(text) == want, text
        assert ours.decode(want, skip_special_tokens=False) == text
    assert ours.apply_chat_template(CHAT) == chat
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    assert tok_config["chat_template"] == gguf.chat_template
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["pad_token"] == "<|im_end|>" and tok_config["add_bos_token"] is False
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(gguf, name)
    assert ours.special_ids == gguf.special_ids


# ---- transformers, where installed ------------------------------------------------------------


def test_transformers_runs_the_export(smollm2_hf, smollm2_path, tmp_path):
    """transformers loads both a tiny random export and SmolLM2's, to the same logits, and
    SmolLM2's tokenizer (with its chat template) to the same ids."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from llmjax.tokenizer import Tokenizer

    tiny = TINY_CONFIGS["qwen2"]
    tiny_params = _random_params(tiny)
    save_hf(tmp_path, tiny, tiny_params)
    cases = [(str(tmp_path), tiny, tiny_params, [5, 17, 3, 200, 9])]
    config, params, out = smollm2_hf
    cases.append((out, config, params, [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]))
    for path, cfg, p, ids in cases:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = full_logits(p, cfg, ids)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    gguf = Tokenizer.from_gguf(smollm2_path)
    chat = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat == gguf.apply_chat_template(CHAT)
    for text in [*TEXTS, chat]:
        assert hf_tok.encode(text) == gguf.encode(text), text


def test_sentencepiece_tokenizer_export(tmp_path):
    """A sentencepiece GGUF vocabulary (Llama 2 style: BOS added, byte fallback) exports too."""
    from tokenizers import Tokenizer as Backend

    from llmjax.checkpoint.hf import save_hf_tokenizer
    from llmjax.tokenizer import Tokenizer
    from tests.test_tokenizer import TOY, _write_gguf

    path = _write_gguf(tmp_path / "toy.gguf", model="llama", meta=TOY["gguf"])
    gguf = Tokenizer.from_gguf(path)
    save_hf_tokenizer(str(tmp_path), path)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.add_bos_token and gguf.add_bos_token
    for case in TOY["cases"]:
        want = gguf.encode(case["text"])
        assert backend.encode(case["text"]).ids == want == ours.encode(case["text"])
        assert ours.decode(want) == gguf.decode(want)
