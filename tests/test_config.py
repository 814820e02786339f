"""Configs: validation errors name the values; presets are valid; HF config parsing."""

import dataclasses
import json

import pytest

import configs
from llmjax.config import CacheConfig, EngineConfig, ModelConfig, RopeScaling, SchedulerConfig


def test_presets_are_valid_and_frozen():
    for name, config in configs.PRESETS.items():
        assert isinstance(config, ModelConfig), name
        assert config.head_dim * config.num_heads >= config.hidden_size // 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        configs.TINY.num_layers = 3
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        configs.get_preset("nope")


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"num_heads": 6, "num_kv_heads": 4},
            "num_heads=6 must be divisible by self.num_kv_heads=4",
        ),
        ({"hidden_size": 0}, "hidden_size"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"architecture": "gpt2"}, "unknown architecture 'gpt2'"),
        ({"sliding_window": -1}, "sliding_window"),
    ],
)
def test_model_config_errors_name_the_values(changes, match):
    with pytest.raises(ValueError, match=match):
        configs.TINY.replace(**changes)


def test_other_config_errors():
    with pytest.raises(ValueError, match="num_pages=1"):
        CacheConfig(num_pages=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype='int8'"):
        EngineConfig(model=configs.TINY, dtype="int8")
    with pytest.raises(ValueError, match="flash_prefill='yes'"):
        EngineConfig(model=configs.TINY, flash_prefill="yes")
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(rope_type="llama3", factor=8, low_freq_factor=4, high_freq_factor=1)
    assert EngineConfig(model=configs.TINY).max_model_len == configs.TINY.max_position_embeddings


def test_pallas_kernel_choice_is_checked_against_the_model():
    with pytest.raises(ValueError, match="pallas_kernel='cuda'"):
        EngineConfig(model=configs.TINY, pallas_kernel="cuda")
    h64 = configs.get_preset("tiny-h64")
    with pytest.raises(ValueError, match=r"bfloat16 or float16.*got float32"):
        EngineConfig(model=h64, pallas_kernel="mgpu")  # float32 by default
    with pytest.raises(ValueError, match="head_dim % 64 == 0, got 16"):
        EngineConfig(model=configs.TINY, dtype="bfloat16", pallas_kernel="mgpu")
    with pytest.raises(ValueError, match="page_size % 8 == 0, got 4"):
        EngineConfig(
            model=h64, dtype="bfloat16", cache=CacheConfig(page_size=4), pallas_kernel="mgpu"
        )
    assert EngineConfig(model=h64, dtype="bfloat16", pallas_kernel="mgpu").pallas_kernel == "mgpu"
    with pytest.raises(ValueError, match="name the kernel with pallas_kernel"):
        EngineConfig(model=configs.TINY, kernel_options="num_stages=2")
    cpu = EngineConfig(model=configs.TINY, attention_backend="cpu", kernel_options="int8_scores=0")
    assert cpu.kernel_options == "int8_scores=0"
    with pytest.raises(ValueError, match="not an integer or true/false"):
        EngineConfig(model=configs.TINY, pallas_kernel="tpu", kernel_options="block_q=big")


def test_overrides_by_dotted_path():
    from llmjax.config import SparseKVConfig, apply_overrides

    base = EngineConfig(model=configs.TINY)
    got = apply_overrides(
        base,
        {
            "scheduler.lpm_max_queue_len": "64",  # strings as flags give them, parsed by type
            "scheduler.balance_micro_batches": "true",
            "cache.watermark": "0.02",
            "cache.num_pages": "none",
            "max_model_len": 100,  # other values as they are
            "sparse_kv.mode": "offload",
            "pallas_kernel": "gpu",
        },
    )
    assert got.scheduler.lpm_max_queue_len == 64 and got.scheduler.balance_micro_batches is True
    assert got.cache.watermark == 0.02 and got.cache.num_pages is None
    assert got.max_model_len == 100 and got.sparse_kv.mode == "offload"
    assert got.pallas_kernel == "gpu"
    assert got.scheduler.policy == base.scheduler.policy  # untouched fields stay
    # Every level is validated again, with its own error.
    with pytest.raises(ValueError, match=r"unknown self\.policy=.fifo."):
        apply_overrides(base, {"scheduler.policy": "fifo"})
    with pytest.raises(ValueError, match=r"'scheduler\.max_num_seq': SchedulerConfig has no "):
        apply_overrides(base, {"scheduler.max_num_seq": "8"})
    with pytest.raises(ValueError, match=r"'cache\.watermark': cannot read 'lots'"):
        apply_overrides(base, {"cache.watermark": "lots"})
    with pytest.raises(ValueError, match="'dtype' is fixed by the loaded weights"):
        apply_overrides(base, {"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"'model\.num_layers' is fixed by the loaded weights"):
        apply_overrides(base, {"model.num_layers": "3"})
    with pytest.raises(ValueError, match=r"'parallel\.tp' is fixed"):
        apply_overrides(base, {"parallel.tp": "2"})
    sparse = apply_overrides(SparseKVConfig(), {"mode": "infinigen", "alpha": "5"})
    assert sparse.mode == "infinigen" and sparse.alpha == 5.0


def test_from_hf_config_reads_old_and_new_rope_keys(tmp_path):
    base = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old = ModelConfig.from_hf_config(base | {"rope_theta": 5e5, "rope_scaling": scaling})
    new = ModelConfig.from_hf_config(base | {"rope_parameters": scaling | {"rope_theta": 5e5}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.factor == 8.0
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf_config(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2}})
    with pytest.raises(ValueError, match="lacks required key 'vocab_size'"):
        ModelConfig.from_hf_config({k: v for k, v in base.items() if k != "vocab_size"})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"unknown architecture model_type='gpt2'.*config.json"):
        ModelConfig.from_hf_config(tmp_path)
