"""The server's Prometheus metrics (llmjax/serve/metrics.py) against what the engine's own outputs
and counters say, after known workloads driven step by step (no HTTP)."""

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmjax import LLM, SamplingParams
from llmjax.serve.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServingMetrics,
    build_1_2_5_buckets,
    metric_prefix,
)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", load_format="dummy", max_model_len=128, num_pages=64, max_num_seqs=8)


def _samples(metrics: ServingMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _run(engine, metrics, requests, abort_after_step=None, abort_id=None):
    """Step the engine to the end, feeding `metrics` as the server's engine thread does; abort
    `abort_id` after step `abort_after_step`. Returns every output of every step."""
    for rid, (ids, params) in requests.items():
        engine.add_request(ids, params, rid)
    seen, step = [], 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step += 1
        metrics.record_step(
            engine.stats,
            outputs,
            0.001,
            len(engine.scheduler.running),
            len(engine.scheduler.waiting),
        )
        seen += outputs
        if step == abort_after_step and engine.abort_request(abort_id):
            metrics.record_abort(abort_id)
    return seen


def test_counters_and_histograms_equal_the_engines_outputs(llm):
    engine = llm.engine
    metrics = ServingMetrics(
        "tiny", engine.config, engine.block_manager.num_pages, stats=engine.stats
    )
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 256, 40).tolist()  # 2 whole pages of 16 shared
    requests = {}
    for i in range(6):
        ids = shared + rng.integers(3, 256, int(rng.integers(1, 20))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(2, 9)), ignore_eos=True)
        requests[f"r{i}"] = (ids, params)
    requests["eos"] = (rng.integers(3, 256, 5).tolist(), SamplingParams(max_tokens=6))
    requests["long"] = (
        rng.integers(3, 256, 9).tolist(),
        SamplingParams(max_tokens=50, ignore_eos=True),
    )
    first = {"r0": requests.pop("r0")}  # runs alone first: the others then hit its prefix
    outputs = _run(engine, metrics, first)
    outputs += _run(engine, metrics, requests, abort_after_step=6, abort_id="long")
    last = {}
    for out in outputs:
        last[out.request_id] = out
    finished = [o for o in last.values() if o.finished]
    aborted = last["long"]
    assert not aborted.finished and len(aborted.token_ids) > 0
    got = _samples(metrics)
    stats = engine.stats

    reasons = {r: sum(o.finish_reason == r for o in finished) for r in ("stop", "length")}
    for reason, count in reasons.items():
        assert got[("llmjax:request_success_total", (("finished_reason", reason),))] == count
    assert got[("llmjax:request_success_total", (("finished_reason", "abort"),))] == 1
    every = [*finished, aborted]
    assert got[("llmjax:generation_tokens_total", ())] == sum(len(o.token_ids) for o in every)
    assert got[("llmjax:prompt_tokens_total", ())] == sum(len(o.prompt_token_ids) for o in every)
    hits = sum(o.num_cached_tokens for o in every)
    assert hits > 0 and got[("llmjax:prefix_cache_hits_total", ())] == hits
    assert got[("llmjax:prefix_cache_queries_total", ())] == hits + stats.num_prefill_tokens
    assert got[("llmjax:iteration_tokens_total_count", ())] == stats.num_steps
    assert got[("llmjax:iteration_tokens_total_sum", ())] == stats.num_batched_tokens
    assert got[("llmjax:batched_tokens_total", ())] == stats.num_batched_tokens
    padded = got[("llmjax:padded_tokens_total", ())]
    assert padded == stats.num_padded_tokens > stats.num_batched_tokens
    assert got[("llmjax:step_duration_seconds_count", ())] == stats.num_steps

    assert got[("llmjax:time_to_first_token_seconds_count", ())] == len(every)
    assert got[("llmjax:time_to_first_token_seconds_sum", ())] == pytest.approx(
        sum(o.metrics.ttft for o in every)
    )
    gaps = [g for o in every for g in o.metrics.tbt]
    assert got[("llmjax:inter_token_latency_seconds_count", ())] == len(gaps)
    assert got[("llmjax:inter_token_latency_seconds_sum", ())] == pytest.approx(sum(gaps))
    for name, values in [
        ("e2e_request_latency_seconds", [o.metrics.e2e_latency for o in finished]),
        ("request_time_per_output_token_seconds", [o.metrics.tpot for o in finished]),
        ("request_generation_tokens", [len(o.token_ids) for o in finished]),
        ("request_prompt_tokens", [len(o.prompt_token_ids) for o in finished]),
        (
            "request_queue_time_seconds",
            [o.metrics.first_scheduled_time - o.metrics.arrival_time for o in finished],
        ),
        (
            "request_decode_time_seconds",
            [o.metrics.token_times[-1] - o.metrics.first_token_time for o in finished],
        ),
    ]:
        assert got[(f"llmjax:{name}_count", ())] == len(finished), name
        assert got[(f"llmjax:{name}_sum", ())] == pytest.approx(sum(values)), name
    assert got[("llmjax:num_requests_running", ())] == 0
    assert got[("llmjax:num_requests_waiting", ())] == 0
    # vLLM's buckets
    ttft_le = sorted(
        float(dict(k[1])["le"]) for k in got if k[0] == "llmjax:time_to_first_token_seconds_bucket"
    )
    assert ttft_le == [*TTFT_BUCKETS, float("inf")]
    itl_le = sorted(
        float(dict(k[1])["le"]) for k in got if k[0] == "llmjax:inter_token_latency_seconds_bucket"
    )
    assert itl_le == [*ITL_BUCKETS, float("inf")]
    assert len(REQUEST_LATENCY_BUCKETS) == 21


def test_preemptions_and_the_prefix(llm):
    small = llm.with_options(num_pages=9, prefix_cache="none")  # 8 usable pages of 16 tokens
    engine = small.engine
    metrics = ServingMetrics(
        "tiny", engine.config, engine.block_manager.num_pages, prefix="vllm", stats=engine.stats
    )
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    requests = {f"p{i}": (rng.integers(3, 256, 20).tolist(), params) for i in range(4)}
    outputs = _run(engine, metrics, requests)
    assert engine.stats.num_preemptions > 0
    got = _samples(metrics)
    assert got[("vllm:num_preemptions_total", ())] == engine.stats.num_preemptions
    assert got[("vllm:prefix_cache_hits_total", ())] == 0
    done = [o for o in outputs if o.finished]
    assert got[("vllm:request_success_total", (("finished_reason", "length"),))] == len(done) == 4
    assert got[("vllm:generation_tokens_total", ())] == 4 * 40
    info = next(k for k in got if k[0] == "vllm:engine_config_info")
    assert ("scheduler_policy", "sarathi") in info[1]


def test_buckets_and_prefix():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000
    assert metric_prefix("vllm") == "vllm:" and metric_prefix("llmjax:") == "llmjax:"
    assert metric_prefix("my_") == "my_"


def test_speculative_decoding_counters(llm):
    spec = llm.with_options(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    )
    engine = spec.engine
    metrics = ServingMetrics(
        "tiny", engine.config, engine.block_manager.num_pages, prefix="vllm", stats=engine.stats
    )
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    requests = {f"s{i}": ([5, 6, 7, 8] * (3 + i), params) for i in range(3)}
    outputs = _run(engine, metrics, requests)
    stats = engine.stats
    assert stats.num_spec_accepted_tokens > 0
    got = _samples(metrics)
    assert got[("vllm:spec_decode_num_drafts_total", ())] == stats.num_spec_drafts
    assert got[("vllm:spec_decode_num_draft_tokens_total", ())] == stats.num_spec_draft_tokens
    assert got[("vllm:spec_decode_num_accepted_tokens_total", ())] == (
        stats.num_spec_accepted_tokens
    )
    assert got[("vllm:generation_tokens_total", ())] == 3 * 30  # several tokens a step, counted
    done = [o for o in outputs if o.finished]
    per_step = sorted(o.metrics.spec_decode.tokens_per_decode_step for o in done)
    assert got[("vllm:request_spec_tokens_per_decode_step_count", ())] == 3
    assert got[("vllm:request_spec_tokens_per_decode_step_sum", ())] == pytest.approx(sum(per_step))
    assert per_step[-1] > 1
