"""LoRA adapters through the OpenAI server (issue 42): `--lora_modules` served by name in the
`model` field (the `openai` client and raw HTTP), /v1/models listing them, vLLM's runtime
load / unload endpoints and their errors, and vLLM's LoRA metric. The tiny HF llama (no
tokenizer: token-id prompts) with the PEFT adapters of tests/testdata/lora/."""

import os

import httpx
import openai
import pytest

from llmjax import LLM, LoRARequest, SamplingParams
from llmjax.serve import Server
from tests.conftest import TESTDATA
from tests.test_serve import TIMEOUT, _client, _error, _metrics, _post, completion_token_ids

LORA = os.path.join(TESTDATA, "lora", "llama")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
BODY = {"prompt": PROMPTS, "max_tokens": 6, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    path = os.path.join(TESTDATA, "hf_tiny", "llama")
    return LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64,
               num_pages=48, compilation_cache_dir="")  # fmt: skip


def _offline(llm, lora):
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    return [o.token_ids for o in llm.generate(PROMPTS, params, lora_request=lora)]


def test_adapters_by_name_and_at_run_time(llm):
    qv = LoRARequest("qv", 1, os.path.join(LORA, "qv_r4"))
    od = LoRARequest("od", 2, os.path.join(LORA, "od_rslora"))
    offline = {None: _offline(llm, None), "qv": _offline(llm, qv), "od": _offline(llm, od)}
    assert offline["qv"] != offline[None] != offline["od"]
    llm.engine.remove_lora(1), llm.engine.remove_lora(2)
    with Server(llm, lora_modules={"qv": qv.lora_path}, enable_lora_runtime_updates=True) as s:
        base = s.model_name
        models = {m.id: m for m in _client(s).models.list().data}
        assert set(models) == {base, "qv"}
        assert models["qv"].parent == base and models["qv"].root == qv.lora_path
        for model, want in ((base, offline[None]), ("qv", offline["qv"])):
            ids, streamed = completion_token_ids(s, BODY | {"model": model})
            assert ids == want and streamed == want, model
        out = _client(s).completions.create(
            model="qv", prompt=PROMPTS[0], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.model == "qv" and out.usage.completion_tokens == 6
        with pytest.raises(openai.NotFoundError):
            _client(s).completions.create(model="od", prompt=PROMPTS[0], max_tokens=2)

        load = {"lora_name": "od", "lora_path": od.lora_path}
        r = _post(s, "/v1/load_lora_adapter", load)
        assert r.status_code == 200 and "od" in r.text, r.text
        _error(_post(s, "/v1/load_lora_adapter", load), 400, "lora_name", "already been loaded")
        bad = {"lora_name": "bad", "lora_path": os.path.join(TESTDATA, "lora", "qwen3", "qkvo_r8")}
        _error(_post(s, "/v1/load_lora_adapter", bad), 400, "lora_path", "another base model")
        ids, _ = completion_token_ids(s, BODY | {"model": "od"})
        assert ids == offline["od"]
        assert {m.id for m in _client(s).models.list().data} == {base, "qv", "od"}
        info = [k for k in _metrics(s) if k[0].endswith("lora_requests_info")]
        assert info and dict(info[0][1])["max_lora"] == "2", info

        r = _post(s, "/v1/unload_lora_adapter", {"lora_name": "od"})
        assert r.status_code == 200, r.text
        _error(_post(s, "/v1/unload_lora_adapter", {"lora_name": "od"}), 404, "lora_name")
        _error(_post(s, "/v1/completions", BODY | {"model": "od"}), 404, "model")
        assert s.call(lambda: sorted(llm.engine.list_loras())) == [1]


def test_runtime_updates_are_off_unless_asked(llm):
    with Server(llm) as s:
        load = {"lora_name": "x", "lora_path": os.path.join(LORA, "qv_r4")}
        _error(_post(s, "/v1/load_lora_adapter", load), 400, None, "--enable_lora_runtime")
        _error(_post(s, "/v1/unload_lora_adapter", {"lora_name": "x"}), 400, None)
        r = httpx.get(s.url + "/openapi.json", timeout=TIMEOUT).json()
        assert "/v1/load_lora_adapter" in r["paths"]
    plain = LLM(os.path.join(TESTDATA, "hf_tiny", "llama"), max_model_len=64, num_pages=16,
                compilation_cache_dir="")  # fmt: skip
    with pytest.raises(ValueError, match="enable_lora"):
        Server(plain, lora_modules={"qv": os.path.join(LORA, "qv_r4")})


def test_a_disaggregated_cluster_serves_adapters(llm):
    """The server in front of a prefill + decode cluster: an adapter by name (moved to the
    decode instance with its request) and one loaded at run time on every instance give the
    offline engine's tokens; the LoRA metric reads the cluster."""
    from llmjax.cluster import InstanceSpec, launch

    qv = LoRARequest("qv", 1, os.path.join(LORA, "qv_r4"))
    od = LoRARequest("od", 2, os.path.join(LORA, "od_rslora"))
    offline = {"qv": _offline(llm, qv), "od": _offline(llm, od)}
    base = os.path.join(TESTDATA, "hf_tiny", "llama")
    cluster = launch(base, InstanceSpec.parse("prefill,decode"), enable_lora=True,
                     max_loras=1, max_lora_rank=8, max_model_len=64, num_pages=48,
                     compilation_cache_dir="")  # fmt: skip
    with Server(cluster, lora_modules={"qv": qv.lora_path}, enable_lora_runtime_updates=True) as s:
        ids, streamed = completion_token_ids(s, BODY | {"model": "qv"})
        assert ids == streamed == offline["qv"]
        load = {"lora_name": "od", "lora_path": od.lora_path}
        assert _post(s, "/v1/load_lora_adapter", load).status_code == 200
        ids, _ = completion_token_ids(s, BODY | {"model": "od"})
        assert ids == offline["od"]
        assert s.call(lambda: [sorted(i.list_loras()) for i in cluster.instances]) == [[1, 2]] * 2
        info = [k for k in _metrics(s) if k[0].endswith("lora_requests_info")]
        assert info and dict(info[0][1])["max_lora"] == "1", info
        assert _post(s, "/v1/unload_lora_adapter", {"lora_name": "od"}).status_code == 200
    assert cluster.transfer_stats.num_transfers == 2 * 2 * len(PROMPTS)  # twice streamed too
    assert all(sorted(i.list_loras()) == [1] for i in cluster.instances)
