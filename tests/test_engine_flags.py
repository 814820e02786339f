"""The scripts' shared engine flags (llmjax/engine_flags.py): short flags and --config.* by path."""

import os
import subprocess
import sys

import pytest
from absl import flags

from llmjax import engine_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _flag_values(*args):
    values = flags.FlagValues()
    engine_flags.define_flags(values)
    values(["prog", *args])
    return values


def test_config_overrides_reach_the_engine():
    from llmjax import LLM

    values = _flag_values(
        "--model=tiny",
        "--load_format=dummy",
        "--max_model_len=64",
        "--config.scheduler.policy=prefill_first",  # its budget default follows (64, not 512)
        "--config.scheduler.lpm_max_queue_len=7",
        "--config.cache.watermark=0.05",
        "--config.cache.num_pages=40",
        "--config.sparse_kv.alpha=3",
        "--config.sparse_kv.max_num_kv=none",
        "--noconfig.parallel.check_lockstep",
        "--config.compilation_cache_dir=",
    )
    overrides = engine_flags.config_overrides(values)
    assert overrides["sparse_kv.alpha"] == 3.0 and overrides["sparse_kv.max_num_kv"] == "none"
    llm = LLM(values.model, **engine_flags.llm_kwargs(values))
    config = llm.config
    assert config.scheduler.policy == "prefill_first"
    assert config.scheduler.max_num_batched_tokens == 64 == config.max_model_len
    assert config.scheduler.lpm_max_queue_len == 7
    assert config.cache.watermark == 0.05 and config.cache.num_pages == 40
    assert llm.engine.block_manager.num_pages == 40
    assert config.sparse_kv.alpha == 3.0 and config.sparse_kv.max_num_kv is None
    assert config.compilation_cache_dir == ""
    # what another script is given to build the same engine
    again = _flag_values(*engine_flags.argv(values))
    assert engine_flags.llm_kwargs(again) == engine_flags.llm_kwargs(values)


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--config.scheduler.policy=fifo", r"scheduler\.policy=fifo: unknown self\.policy='fifo'"),
        ("--config.cache.watermark=2", r"self\.watermark=2\.0 must be in \[0, 1\)"),
        ("--config.sparse_kv.max_num_kv=lots", r"cannot read 'lots' as int \| None"),
        ("--config.model.num_layers=3", r"model\.num_layers is fixed by the loaded weights"),
        ("--config.parallel.tp=2", r"parallel\.tp is fixed by the .* set it with --tp"),
        ("--config.dtype=bfloat16", r"fixed by the loaded weights; set it with --dtype"),
    ],
)
def test_bad_overrides_fail_at_parse_time_with_the_dataclass_message(arg, message):
    with pytest.raises(flags.IllegalFlagValueError, match=message):
        _flag_values(arg)


def test_unknown_path_is_refused():
    with pytest.raises(flags.UnrecognizedFlagError, match=r"config\.scheduler\.max_num_seq\b"):
        _flag_values("--config.scheduler.max_num_seq=8")


def test_script_help_lists_the_fields_and_a_bad_value_stops_it():
    script = os.path.join(ROOT, "scripts", "generate.py")
    help_text = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True, env=ENV
    ).stdout
    for field in ("scheduler.policy", "cache.watermark", "sparse_kv.alpha", "precompile"):
        assert f"    {field} (" in help_text, field
    assert "--tp" in help_text and "--attention_backend" in help_text
    bad = subprocess.run(
        [sys.executable, script, "--config.scheduler.admission_order=random"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert bad.returncode != 0
    assert "unknown self.admission_order='random'" in bad.stderr


def test_speculative_config_from_json_and_by_path():
    from llmjax import LLM

    values = _flag_values(
        "--model=tiny",
        "--load_format=dummy",
        "--max_model_len=64",
        '--speculative_config={"method": "ngram", "num_speculative_tokens": 2}',
        "--config.compilation_cache_dir=",
    )
    llm = LLM(values.model, **engine_flags.llm_kwargs(values))
    spec = llm.engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 2)
    assert llm.engine.speculator is not None
    values = _flag_values(
        "--config.speculative.method=ngram", "--config.speculative.prompt_lookup_max=6"
    )
    assert engine_flags.config_overrides(values) == {
        "speculative.method": "ngram",
        "speculative.prompt_lookup_max": 6,
    }
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        engine_flags.llm_kwargs(_flag_values('--speculative_config={"method": "ngram", "k": 2}'))
    with pytest.raises(ValueError, match="not JSON"):
        engine_flags.llm_kwargs(_flag_values("--speculative_config=ngram"))
