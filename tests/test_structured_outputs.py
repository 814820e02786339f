"""Structured outputs (issue 24, item 2): llguidance's token masks applied exactly before
sampling, outputs that always parse and validate (JSON schemas, regexes, choices, grammars over
many seeds), clear errors for bad grammars, unconstrained requests untouched."""

from __future__ import annotations

import functools
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from llmjax import LLM, SamplingParams
from llmjax.model.sampler import apply_bitmask
from llmjax.sampling_params import StructuredOutputsParams as SO
from tests.helpers import full_logits

pytest.importorskip("llguidance")


def test_apply_bitmask_keeps_exactly_the_set_bits():
    rng = np.random.default_rng(0)
    for V in (31, 32, 100):
        W = (V + 31) // 32
        logits = rng.normal(size=(3, V)).astype(np.float32)
        mask = rng.integers(-(2**31), 2**31, size=(3, W), dtype=np.int64).astype(np.int32)
        got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
        bits = (mask.astype(np.int64)[:, :, None] >> np.arange(32)) & 1
        allowed = bits.reshape(3, -1)[:, :V].astype(bool)
        np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


@functools.cache
def _tiny(smollm2_path: str):
    """SmolLM2's tokenizer on a random 2-layer body: fast, and its greedy choices arbitrary."""
    return LLM(
        "smollm2-tiny",
        load_format="dummy",
        tokenizer=smollm2_path,
        max_model_len=256,
        num_pages=128,
        max_num_batched_tokens=128,
        compilation_cache_dir="",
    )


def test_the_mask_is_applied_exactly_even_against_the_argmax(smollm2_path):
    llm = _tiny(smollm2_path)
    tok = llm.get_tokenizer()
    prompt = tok.encode("Answer:")
    free = llm.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    banned = tok.decode([free])
    choices = [c for c in ("yes", "no", "perhaps", "1234") if not c.startswith(banned[:1])]
    spec = SO(choice=choices)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, structured_outputs=spec))[0]
    assert out.text in choices and out.finish_reason == "stop"
    assert out.token_ids[0] != free  # the model's own argmax was illegal
    # Exactly the argmax over the allowed tokens of the reference forward's logits.
    matcher = llm.engine.structured.matcher(spec)
    mask = llm.engine.structured.bitmask([(0, matcher)], 1)
    logits = full_logits(llm.engine.runner.params, llm.model_config, prompt)[-1]
    allowed = np.asarray(apply_bitmask(jnp.asarray(logits[None]), jnp.asarray(mask)))[0]
    assert out.token_ids[0] == int(np.argmax(allowed))


def test_bad_grammars_are_errors_naming_them_and_others_are_served(smollm2_path):
    llm = _tiny(smollm2_path)
    bad = [
        SO(regex="a(b"),
        SO(json={"type": "objectx"}),
        SO(grammar="start: nope"),
    ]
    params = [SamplingParams(max_tokens=4, structured_outputs=s) for s in bad]
    outs = llm.generate(["hi"] * 3 + ["ok"], [*params, SamplingParams(max_tokens=3)])
    for o, s in zip(outs[:3], bad, strict=True):
        assert o.finish_reason == "error" and f"structured_outputs.{s.kind}" in o.error
    assert len(outs[3].token_ids) == 3
    with pytest.raises(ValueError, match="exactly one of"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        SO()


def test_unconstrained_requests_pay_nothing(smollm2_path, monkeypatch):
    llm = _tiny(smollm2_path).with_options()
    calls = []
    real = type(llm.engine.structured).bitmask
    monkeypatch.setattr(
        type(llm.engine.structured), "bitmask", lambda *a: calls.append(1) or real(*a)
    )
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    before = llm.generate(["one", "two"], plain)
    assert not calls
    word = SamplingParams(max_tokens=6, structured_outputs=SO(regex="[a-z]{6}"))
    mixed = llm.generate(["one", "two", "three"], [plain, plain, word])
    assert calls and [o.token_ids for o in mixed[:2]] == [o.token_ids for o in before]
    assert re.fullmatch("[a-z]{6}", mixed[2].text)


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
]


@pytest.mark.slow
def test_smollm2_outputs_always_parse_and_validate(smollm2_path):
    llm = LLM(smollm2_path, max_model_len=512, num_pages=256, compilation_cache_dir="")
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a person in JSON."}])
    cases = []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(4):
            cases.append(("json", schema, SO(json=schema), seed + 10 * i))
    for seed in range(3):
        cases.append(("regex", r"\d{3}-[a-z]{2,4}", SO(regex=r"\d{3}-[a-z]{2,4}"), seed))
        cases.append(("choice", ["cat", "dog", "bird"], SO(choice=["cat", "dog", "bird"]), seed))
        cases.append(("json_object", None, SO(json_object=True), seed))
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs=spec)
        for _, _, spec, seed in cases
    ]
    params.append(SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=120,
                                 structured_outputs=SO(json=SCHEMAS[0])))  # fmt: skip
    outs = llm.generate([prompt] * len(params), params)
    for (kind, target, spec, _), out in zip(cases, outs, strict=False):
        if kind == "json_object" and out.finish_reason == "length":
            # Any JSON object is allowed, so a sampled one may run past max_tokens (at
            # temperature 1 about half of them do): what it wrote must be a prefix the
            # grammar accepts, token by token.
            matcher = llm.engine.structured.matcher(spec)
            assert all(matcher.consume_token(t) for t in out.token_ids), out.text
            assert out.text.lstrip().startswith("{")
            continue
        assert out.finish_reason == "stop", (kind, out.text)
        if kind == "json":
            jsonschema.validate(json.loads(out.text), target)
        elif kind == "json_object":
            assert isinstance(json.loads(out.text), dict)
        elif kind == "regex":
            assert re.fullmatch(target, out.text), out.text
        else:
            assert out.text in target
    samples = outs[-1].outputs
    assert len(samples) == 3
    for s in samples:
        jsonschema.validate(json.loads(s.text), SCHEMAS[0])
