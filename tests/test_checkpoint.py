"""Checkpoint loaders: GGUF (written here from the tiny HF checkpoints) against HF, the real
SmolLM2 GGUF's metadata, orbax round trips, and clear errors for missing or broken checkpoints."""

import dataclasses
import json
import math
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax.checkpoint import load_gguf, load_hf, load_model, restore_params, save_params
from llmjax.checkpoint.gguf import model_config_from_gguf, unpermute_rope_rows
from llmjax.config import ModelConfig
from llmjax.model.params import init_params
from tests.conftest import TESTDATA
from tests.helpers import full_logits

HF_TINY = os.path.join(TESTDATA, "hf_tiny")

# ModelConfig fields that fix the parameter shapes and the model's computation.
SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "rope_theta",
    "rope_scaling",
    "sliding_window",
    "qk_norm",
    "norm_plus_one",
    "post_norms",
    "scale_embeddings",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "hidden_act",
    "layer_types",
    "rope_local_base_freq",
)


# ------------------------------------------------------------------------------------------------
# Helpers


def hf_dir(name: str) -> str:
    return os.path.join(HF_TINY, name)


def copy_hf(name: str, tmp_path) -> str:
    """A writable copy of a tiny HF checkpoint (never corrupt the originals)."""
    dst = os.path.join(tmp_path, name)
    shutil.copytree(hf_dir(name), dst)
    return dst


def read_hf_tensors(directory: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for n in sorted(os.listdir(directory)):
        if n.endswith(".safetensors"):
            out |= load_file(os.path.join(directory, n))
    return out


def truncate(path: str, keep: float | int = 0.5) -> None:
    """Cut a file to `keep` bytes (an int) or to that fraction of its size (a float)."""
    size = keep if isinstance(keep, int) else int(os.path.getsize(path) * keep)
    with open(path, "r+b") as f:
        f.truncate(size)


def edit_json(path: str, **changes) -> None:
    """Set top-level keys of a JSON file (a value of None deletes the key)."""
    with open(path) as f:
        d = json.load(f)
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    with open(path, "w") as f:
        json.dump(d, f)


def write_safetensors_bf16(path: str, tensors: dict[str, np.ndarray]) -> None:
    """safetensors with BF16 tensors, written by hand (numpy has no bfloat16 of its own)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        blob = np.asarray(t, jnp.bfloat16).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def assert_same_params(got, want):
    """Same tree, shapes, dtypes and values (chex names the first leaf that differs)."""
    chex.assert_trees_all_equal_structs(got, want)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_equal(got, want)


def assert_same_shape_fields(got: ModelConfig, want: ModelConfig):
    for field in SHAPE_FIELDS:
        assert getattr(got, field) == getattr(want, field), field
    # GGUF stores eps as float32.
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (Q/K rows: halves -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str, arch: str = "llama") -> str:
    """llama.cpp's name for HF tensor `hf` in an `arch` file, from gguf-py's own table (the one
    llama.cpp's converter uses)."""
    import gguf

    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(arch_enum, 64)
    name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf
    return name


def write_gguf(
    path,
    name: str,
    *,
    arch: str | None = None,
    drop: str | None = None,
    dtype=np.float32,
    extra_tensors: dict | None = None,
    quant: str | None = None,
) -> str:
    """Convert tiny HF checkpoint `name` to a GGUF file the way llama.cpp does (F32, or F16 for
    the matrices with dtype=np.float16; with `quant`, e.g. "Q4_1", the layers' matrices in that
    block type -- a mixture's stacked experts too -- and the embedding in Q8_0, as SmolLM2's
    file), with `extra_tensors` (GGUF name ->
    array) added."""
    import gguf

    with open(os.path.join(hf_dir(name), "config.json")) as f:
        hf = json.load(f)
    family = {"gemma3_text": "gemma3"}.get(hf["model_type"], hf["model_type"])
    names_arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}.get(
        family, family
    )  # llama.cpp's architecture for the family: its tensor names
    arch = arch or names_arch
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    rope = hf["rope_parameters"]
    rope_global = rope.get("full_attention", rope)
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope_global["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(hf["vocab_size"])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:  # as llama.cpp's MixtralModel (a llama file), Qwen2MoeModel, Qwen3MoeModel write
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
        if hf.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        if hf.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    if rope_global.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_global["factor"])
    gemma = family in ("gemma2", "gemma3")
    if gemma:  # as llama.cpp's Gemma2Model / Gemma3Model write them
        w.add_sliding_window(hf["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
        if hf.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        if hf.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        if hf["query_pre_attn_scalar"] != head_dim:  # llama.cpp's default for these shapes
            w.add_attention_scale(hf["query_pre_attn_scalar"] ** -0.5)
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    tensors = read_hf_tensors(hf_dir(name))
    if experts:  # each projection's experts stacked [E, out, in] under the merged HF name
        by_merged = {}
        for hf_name in list(tensors):
            m = re.fullmatch(r"(.*\.experts)\.(\d+)(\.\w+\.weight)", hf_name)
            if m:
                by_merged.setdefault(m[1] + m[3], {})[int(m[2])] = tensors.pop(hf_name)
        for merged, per_expert in by_merged.items():
            tensors[merged] = np.stack([per_expert[e] for e in range(experts)])
    for hf_name, t in tensors.items():
        if hf_name == drop:
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            t = np.asarray(t).reshape(-1)  # llama.cpp's [D]
        t = np.asarray(t, np.float32)
        if names_arch == "llama" and ".q_proj." in hf_name:  # only llama's rows are permuted
            t = llama_cpp_permute(t, n_head)
        elif names_arch == "llama" and ".k_proj." in hf_name:
            t = llama_cpp_permute(t, n_kv)
        if gemma and hf_name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if quant is not None and (t.ndim == 2 or (t.ndim == 3 and ".experts." in hf_name)):
            qtype = gguf.GGMLQuantizationType["Q8_0" if "embed" in hf_name else quant]
            data = gguf.quants.quantize(np.ascontiguousarray(t), qtype)
            w.add_tensor(gguf_name(hf_name, names_arch), data, raw_dtype=qtype)
            continue
        if t.ndim == 2:
            t = t.astype(dtype)
        w.add_tensor(gguf_name(hf_name, names_arch), np.ascontiguousarray(t))
    for gguf_tensor, t in (extra_tensors or {}).items():
        w.add_tensor(gguf_tensor, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------------
# 1. GGUF written from the tiny HF checkpoints


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("head_dim", [2, 8, 64])
def test_unpermute_rope_rows_inverts_llama_cpp_permutation(num_heads, head_dim):
    rng = np.random.default_rng(num_heads * 100 + head_dim)
    w = rng.standard_normal((num_heads * head_dim, 5)).astype(np.float32)
    b = rng.standard_normal(num_heads * head_dim).astype(np.float32)
    permuted = llama_cpp_permute(w, num_heads)
    if head_dim > 2:  # with two dims per head the permutation is the identity
        assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, num_heads), w)
    np.testing.assert_array_equal(
        unpermute_rope_rows(llama_cpp_permute(b, num_heads), num_heads), b
    )


def test_unpermute_rope_rows_layout():
    # One head of 4 dims: HF rows [a0, a1, b0, b1] (halves) <- llama.cpp rows [a0, b0, a1, b1].
    w = np.array([0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute_rope_rows(w, 1), [0, 1, 2, 3])


@pytest.mark.parametrize(
    "name",
    ["llama", "qwen2", "llama_tied", "qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe",
     "qwen3_moe"],
)  # fmt: skip
def test_gguf_matches_hf(name, tmp_path):
    path = write_gguf(tmp_path / f"{name}.gguf", name)
    hf_config, hf_params = load_hf(hf_dir(name))
    config, params = load_gguf(path)
    assert_same_shape_fields(config, hf_config)
    assert config.name == f"tiny-{name}"
    assert config.bos_token_id == hf_config.bos_token_id
    assert config.eos_token_ids == hf_config.eos_token_ids
    if config.norm_plus_one:  # Gemma's norms went through 1 + w in float32 and back
        chex.assert_trees_all_close(params, hf_params, atol=2e-7, rtol=0)
        params = hf_params
    assert_same_params(params, hf_params)
    if name == "qwen2":
        assert config.attention_bias and "bq" in params["layers"][0]
    if name in ("qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"):
        # the file's logits are HF's
        golden = np.load(os.path.join(hf_dir(name), "golden.npz"))
        n = golden["lengths"][0]
        _, gguf_params = load_gguf(path)
        got = full_logits(gguf_params, config, golden["input_ids"][0][:n].tolist(), page_size=8)
        want = golden["logits"][0][:n]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

    # Through the dispatcher too, and in another dtype.
    config2, params2, kind = load_model(path, np.float16)
    assert kind == "gguf" and config2 == config
    want16 = jax.tree.map(lambda x: x.astype(np.float16), hf_params)
    if config.norm_plus_one:  # 1 + w - 1 rounds differently once in float16
        chex.assert_trees_all_close(params2, want16, atol=1e-3, rtol=0)
    else:
        assert_same_params(params2, want16)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_moe_gguf_keeps_its_expert_blocks(tmp_path, quant):
    """A Qwen2-MoE GGUF with its matrices and stacked experts ([E, out, in] tensors) in a block
    type, loaded with quantized=True (quantization='gguf'): attention and experts stay packed,
    each expert's blocks as a 2-D tensor of that type would load, and the logits are those of the
    dequantized load up to the activations' 8-bit quantization (the kernels' W8A8)."""
    import gguf

    from llmjax.checkpoint.gguf import packed_from_gguf
    from llmjax.model.quant import dequantize, is_packed

    path = write_gguf(tmp_path / "moe.gguf", "qwen2_moe", quant=quant)
    config, packed = load_gguf(path, quantized=True)
    _, dense = load_gguf(path)
    layer = packed["layers"][1]
    E, D, Fe = config.num_experts, config.hidden_size, config.expert_intermediate_size
    assert is_packed(layer["wq"]) and is_packed(layer["we_gate"]) and is_packed(layer["we_down"])
    assert layer["we_gate"].shape == (E, D, Fe) and layer["we_down"].shape == (E, Fe, D)
    assert layer["we_gate"].fmt == quant.lower() and layer["we_gate"].values.shape[:2] == (E, Fe)
    np.testing.assert_array_equal(
        np.asarray(dequantize(layer["we_down"], np.float32, np)), dense["layers"][1]["we_down"]
    )
    # expert 3 of the stacked tensor = that expert's rows as a 2-D tensor of the block type
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up_exps.weight")
    rows = np.asarray(t.data).reshape(E, Fe, -1)[3]
    one = packed_from_gguf(
        type("T", (), {"tensor_type": t.tensor_type, "data": rows, "shape": (0, Fe)}), (D, Fe), 1
    )
    np.testing.assert_array_equal(layer["we_up"].values[3], one.values)
    np.testing.assert_array_equal(layer["we_up"].scales[3], one.scales)
    tokens = [5, 17, 42, 99, 3, 64, 7]
    got = full_logits(packed, config, tokens, page_size=4)
    want = full_logits(dense, config, tokens, page_size=4)
    err = np.abs(got - want).max() / np.abs(want).max()
    # 8-bit activations through 2 layers: 0.015 (Q8_0) and 0.019 (Q4_1) of the largest logit on
    # a CPU whose qmatmul kernel is vectorized, 0 where the blocks are dequantized into XLA's dot
    assert err < 0.05, err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 6 / 7


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a llama3 rope_scaling: one divisor
    per frequency (1 for short wavelengths, `factor` for long ones, a smooth ramp between)."""
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_gguf_rope_freqs_give_the_hf_llama3_scaling(tmp_path):
    """A Llama 3.1+ GGUF carries llama.cpp's rope_freqs instead of the llama3 parameters: loaded
    as RopeScaling('freq_factors'), the frequencies and the model's logits (on positions past
    original_max_position_embeddings, 32 here, where the scaling acts) equal the HF checkpoint's."""
    from llmjax.model.layers import rope_inv_freq

    with open(os.path.join(hf_dir("llama3_rope"), "config.json")) as f:
        hf = json.load(f)
    factors = llama_cpp_rope_freqs(hf["rope_parameters"], hf["head_dim"])
    assert 1.0 in factors and 8.0 in factors  # (this tiny config has no ramp: see below)
    path = write_gguf(
        tmp_path / "llama3_rope.gguf", "llama3_rope", extra_tensors={"rope_freqs.weight": factors}
    )
    hf_config, hf_params = load_hf(hf_dir("llama3_rope"))
    config, params = load_gguf(path)
    assert hf_config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.rope_type == "freq_factors" and config.rope_scaling.factor == 8.0
    np.testing.assert_allclose(
        rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
        rope_inv_freq(hf_config.head_dim, hf_config.rope_theta, hf_config.rope_scaling),
        rtol=1e-6,
    )
    assert_same_params(params, hf_params)
    ids = list(np.random.default_rng(0).integers(3, 256, 48))
    want = full_logits(hf_params, hf_config, ids)
    np.testing.assert_allclose(full_logits(params, config, ids), want, rtol=0, atol=1e-4)
    unscaled = full_logits(params, config.replace(rope_scaling=None), ids)
    assert np.abs(unscaled - want).max() > 1e-2  # the scaling matters at these positions


def test_rope_freq_factors_equal_llama3_scaling_on_llama31_8b():
    """Llama 3.1 8B's parameters (head dim 128, theta 5e5, factor 8, 1 / 4, 8192 positions): the
    divisors llama.cpp writes reproduce the llama3 frequencies, the smooth ramp included."""
    from llmjax.config import RopeScaling
    from llmjax.model.layers import rope_inv_freq

    rope = dict(
        rope_theta=5e5,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    factors = llama_cpp_rope_freqs(rope, 128)
    assert ((factors > 1) & (factors < 8)).sum() >= 3  # the ramp
    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(
        rope_inv_freq(128, 5e5, RopeScaling("freq_factors", 8.0, freq_factors=tuple(factors))),
        rope_inv_freq(128, 5e5, llama3),
        rtol=1e-6,
    )


def test_rope_freq_factors_are_checked():
    from llmjax.config import RopeScaling

    with pytest.raises(ValueError, match=r"3 rope freq_factors for self\.head_dim=16"):
        configs.TINY.replace(
            rope_scaling=RopeScaling("freq_factors", 1.0, freq_factors=(1.0, 2.0, 3.0))
        )
    with pytest.raises(ValueError, match="freq_factors go with rope_type='freq_factors'"):
        RopeScaling("freq_factors", 1.0)
    with pytest.raises(ValueError, match="must be positive"):
        RopeScaling("freq_factors", 1.0, freq_factors=(1.0, 0.0))


def test_gguf_f16_matches_hf_rounded(tmp_path):
    path = write_gguf(tmp_path / "f16.gguf", "llama", dtype=np.float16)
    _, hf_params = load_hf(hf_dir("llama"))
    _, params = load_gguf(path)
    # Matrices went through float16; the norm scales stayed float32 (as llama.cpp keeps them).
    want = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x.astype(np.float16),
        hf_params,
    )
    want = jax.tree.map(lambda x: x.astype(np.float32), want)
    assert_same_params(params, want)


def test_hf_bf16_safetensors(tmp_path):
    d = copy_hf("llama", tmp_path)
    tensors = read_hf_tensors(d)
    write_safetensors_bf16(os.path.join(d, "model.safetensors"), tensors)
    _, hf_params = load_hf(hf_dir("llama"))
    _, params = load_hf(d)
    want = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(np.float32), hf_params)
    assert_same_params(params, want)


# ------------------------------------------------------------------------------------------------
# 2. The real SmolLM2 GGUF's metadata


def test_smollm2_gguf_config_matches_preset_and_hf_config(smollm2_path):
    config = model_config_from_gguf(smollm2_path)
    assert_same_shape_fields(config, configs.SMOLLM2_135M)
    assert config.bos_token_id == configs.SMOLLM2_135M.bos_token_id
    assert config.eos_token_ids == configs.SMOLLM2_135M.eos_token_ids

    hf = ModelConfig.from_hf_config(os.path.join(TESTDATA, "smollm2_hf_config.json"))
    assert_same_shape_fields(hf, configs.SMOLLM2_135M)
    # transformers read that config.json out of the same GGUF: everything but the name agrees.
    assert dataclasses.replace(hf, name="") == dataclasses.replace(config, name="")


# ------------------------------------------------------------------------------------------------
# 3. Orbax


@pytest.fixture(scope="module")
def orbax_llama(tmp_path_factory):
    config, params = load_hf(hf_dir("llama"))
    directory = str(tmp_path_factory.mktemp("orbax") / "llama")
    save_params(directory, config, params)
    return directory, config, params


def test_orbax_round_trip_hf_llama(orbax_llama):
    directory, config, params = orbax_llama
    got_config, got = restore_params(directory)
    assert got_config == config
    assert_same_params(got, jax.tree.map(jnp.asarray, params))

    _, got16 = restore_params(directory, jnp.bfloat16)
    assert_same_params(got16, jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params))

    got_config, got, kind = load_model(directory)
    assert kind == "orbax" and got_config == config
    assert_same_params(got, jax.tree.map(jnp.asarray, params))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_random_tiny(dtype, tmp_path):
    params = init_params(configs.TINY, jax.random.key(3), dtype)
    save_params(tmp_path / "ckpt", configs.TINY, params)
    config, got = restore_params(tmp_path / "ckpt", dtype)
    assert config == configs.TINY
    assert_same_params(got, params)


def test_llm_from_orbax_dir_matches_hf_greedy(orbax_llama):
    from llmjax import LLM, SamplingParams

    directory, _, _ = orbax_llama
    golden = np.load(os.path.join(hf_dir("llama"), "golden.npz"))
    n = golden["lengths"][0]
    prompt = golden["input_ids"][0][:n].tolist()
    llm = LLM(directory, page_size=4, max_num_batched_tokens=16, compilation_cache_dir="")
    sp = SamplingParams(max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    assert llm.generate([prompt], sp)[0].token_ids == golden["greedy_ids"].tolist()


# ------------------------------------------------------------------------------------------------
# 4. Missing and broken checkpoints: the right error type, naming the file (and the tensor)


def test_missing_paths(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_gguf(missing + ".gguf")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_hf(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        restore_params(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        model_config_from_gguf(missing + ".gguf")


def test_directory_that_is_no_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        load_model(str(tmp_path))


def test_hf_dir_without_safetensors(tmp_path):
    d = copy_hf("llama", tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=re.escape(d)):
        load_hf(d)
    with pytest.raises(FileNotFoundError, match=re.escape(d)):
        load_model(d)


def test_hf_missing_shard(tmp_path):
    d = copy_hf("llama_sharded", tmp_path)
    shard = os.path.join(d, "model-00003-of-00005.safetensors")
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=re.escape(shard)):
        load_hf(d)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', "[1, 2]"])
def test_hf_corrupt_shard_index(text, tmp_path):
    d = copy_hf("llama_sharded", tmp_path)
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=re.escape(index)):
        load_hf(d)


def test_hf_wrong_shape(tmp_path):
    d = copy_hf("llama", tmp_path)
    cfg_path = os.path.join(d, "config.json")
    edit_json(cfg_path, intermediate_size=96)
    expected = re.escape(
        "'model.layers.0.mlp.gate_proj.weight' has shape (128, 64), expected (96, 64)"
    )
    with pytest.raises(ValueError, match=expected):
        load_hf(d)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.up_proj.weight", "lm_head.weight"])
def test_hf_missing_tensor(missing, tmp_path):
    from safetensors.numpy import save_file

    d = copy_hf("llama", tmp_path)
    tensors = read_hf_tensors(d)
    del tensors[missing]
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=f"{re.escape(d)}.*{re.escape(repr(missing))}"):
        load_hf(d)


def test_gguf_missing_tensor(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", "llama", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=f"{re.escape(path)}.*model.layers.1.mlp.up_proj.weight"):
        load_gguf(path)


def test_gguf_wrong_shape(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "t.gguf", "llama")
    # Rewrite with a feed_forward_length that disagrees with the tensors.
    reader = gguf.GGUFReader(path)
    assert int(reader.fields["llama.feed_forward_length"].contents()) == 128
    bad = str(tmp_path / "bad.gguf")
    with open(path, "rb") as f:
        data = f.read()
    key = b"llama.feed_forward_length"
    i = data.index(key) + len(key) + 4  # then the value type (u32), then the value
    assert int.from_bytes(data[i : i + 4], "little") == 128
    with open(bad, "wb") as f:
        f.write(data[:i] + (96).to_bytes(4, "little") + data[i + 4 :])
    with pytest.raises(ValueError, match=f"{re.escape(bad)}.*gate_proj.weight.*(128, 64)"):
        load_gguf(bad)


def test_unknown_architecture_hf(tmp_path):
    d = copy_hf("llama", tmp_path)
    cfg_path = os.path.join(d, "config.json")
    edit_json(cfg_path, model_type="gpt2")
    with pytest.raises(ValueError, match=f"'gpt2'.*{re.escape(cfg_path)}"):
        load_hf(d)
    with pytest.raises(ValueError, match="gpt2"):
        load_model(d)


def test_unknown_architecture_gguf(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "llama", arch="gpt2")
    with pytest.raises(ValueError, match=f"{re.escape(path)}.*'gpt2'"):
        load_gguf(path)
    with pytest.raises(ValueError, match=f"{re.escape(path)}.*'gpt2'"):
        model_config_from_gguf(path)


@pytest.mark.parametrize(
    ("name", "file"),
    [("llama", "model.safetensors"), ("llama_sharded", "model-00004-of-00005.safetensors")],
)
@pytest.mark.parametrize("keep", [0.5, 0.02, 100, 4])  # in the data, in the header, in its length
def test_truncated_safetensors(name, file, keep, tmp_path):
    d = copy_hf(name, tmp_path)
    path = os.path.join(d, file)
    truncate(path, keep)
    with pytest.raises(ValueError, match=re.escape(path)):
        load_hf(d)
    with pytest.raises(ValueError, match=re.escape(path)):
        load_model(d)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.05, 100, 0])
def test_truncated_gguf(keep, tmp_path):
    path = write_gguf(tmp_path / "t.gguf", "llama")
    truncate(path, keep)
    with pytest.raises(ValueError, match=re.escape(path)):
        load_gguf(path)
    with pytest.raises(ValueError, match=re.escape(path)):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = str(tmp_path / "junk.gguf")
    with open(path, "wb") as f:
        f.write(b"this is not a gguf file" * 100)
    with pytest.raises(ValueError, match=re.escape(path)):
        load_gguf(path)


def test_corrupt_config_json(tmp_path):
    d = copy_hf("llama", tmp_path)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path, "w") as f:
        f.write('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=re.escape(cfg_path)):
        load_hf(d)
    with pytest.raises(ValueError, match=re.escape(cfg_path)):
        load_model(d)


def test_config_json_missing_key(tmp_path):
    d = copy_hf("llama", tmp_path)
    cfg_path = os.path.join(d, "config.json")
    edit_json(cfg_path, hidden_size=None)
    with pytest.raises(ValueError, match=f"{re.escape(cfg_path)}.*'hidden_size'"):
        load_hf(d)


def test_non_gguf_file_as_model(tmp_path):
    path = str(tmp_path / "weights.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    with pytest.raises(ValueError, match=re.escape(path)):
        load_model(path)
    # A single safetensors file is not a model either: it needs its config.json directory.
    st = os.path.join(hf_dir("llama"), "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(st)):
        load_model(st)


def test_orbax_dir_without_params(orbax_llama, tmp_path):
    src, _, _ = orbax_llama
    d = str(tmp_path / "ckpt")
    shutil.copytree(src, d)
    shutil.rmtree(os.path.join(d, "params"))
    with pytest.raises(FileNotFoundError, match=re.escape(d)):
        restore_params(d)


def test_orbax_config_disagrees_with_params(orbax_llama, tmp_path):
    src, _, _ = orbax_llama
    d = str(tmp_path / "ckpt")
    shutil.copytree(src, d)
    cfg_path = os.path.join(d, "llmjax_model_config.json")
    edit_json(cfg_path, intermediate_size=96)
    with pytest.raises(ValueError, match=re.escape(os.path.join(d, "params"))):
        restore_params(d)


@pytest.mark.parametrize("text", ["{oops", '{"vocab_size": 256}', "[]", '{"colour": 1}'])
def test_orbax_corrupt_config(text, orbax_llama, tmp_path):
    src, _, _ = orbax_llama
    d = str(tmp_path / "ckpt")
    shutil.copytree(src, d)
    cfg_path = os.path.join(d, "llmjax_model_config.json")
    with open(cfg_path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=re.escape(cfg_path)):
        restore_params(d)
