"""The applications (llmjax/program/apps/), the workload driver and scripts/bench_programs.py, on
the simulated engine (no jax) and, marked slow, on SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from program_helpers import ByteTokenizer, sim_engine

from configs.llama2 import LLAMA2_7B
from llmjax.config import ProgramConfig
from llmjax.program import Program, ProgramExecutor
from llmjax.program.apps import AppParams, chain_summary, document_chunks, map_reduce, multi_agent
from llmjax.program.apps.mixed import mixed_jobs
from llmjax.program.reference import run_sequential
from llmjax.program.workload import record, run_jobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ChatByteTokenizer(ByteTokenizer):
    """ByteTokenizer with a chat template, for the apps' chat functions."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


TOK = ChatByteTokenizer()
PARAMS = AppParams(output_tokens=8, short_tokens=4, exact=True)


def test_document_chunks_are_token_windows_of_the_text():
    chunks = document_chunks(TOK, 3, 50, offset=10)
    assert len(chunks) == 3 and all(0 < len(TOK.encode(c, False)) <= 50 for c in chunks)
    assert len(set(chunks)) == 3
    with pytest.raises(ValueError, match="num_chunks"):
        document_chunks(TOK, 0, 10)


@pytest.mark.parametrize(
    "build, num_tasks",
    [
        (lambda p, c: chain_summary(p, c, PARAMS), 4),
        (lambda p, c: map_reduce(p, c, PARAMS), 5),
        (lambda p, c: multi_agent(p, "a calculator", 2, PARAMS, charter="Be careful. " * 6), 7),
    ],
)
def test_apps_run_and_equal_their_calls_one_by_one(build, num_tasks):
    chunks = document_chunks(TOK, 4, 40)
    engine = sim_engine(num_pages=1024)
    ex = ProgramExecutor(engine, tokenizer=TOK)
    with Program(ex) as p:
        gets = build(p, chunks)
        values = [v.get(c) for v, c in gets]
    assert len(ex.records) == num_tasks and all(values)
    ref = run_sequential(sim_engine(num_pages=1024), p.functions, p.constants, p.calls, TOK)
    assert values == [ref[v.id][0] for v, _ in gets]


def test_run_jobs_opens_each_program_at_its_arrival():
    chunks = document_chunks(TOK, 3, 30)
    jobs = [
        record("early", lambda p: map_reduce(p, chunks, PARAMS), 0.0),
        record("late", lambda p: chain_summary(p, chunks, PARAMS), 5.0),
    ]
    ex = ProgramExecutor(sim_engine(num_pages=1024), tokenizer=TOK)
    early, late = run_jobs(ex, jobs)
    assert early.end < 5.0  # it finished before the second one arrived (simulated seconds)
    first_late = min(r["dispatch"] for r in ex.records if r["app"] == "late")
    assert first_late == pytest.approx(5.0)
    assert late.latency == pytest.approx(late.end - 5.0) and late.latency > 0
    assert not early.errors and not late.errors


def test_mixed_workload_protects_the_chats_with_a_zero_budget():
    chunks = document_chunks(TOK, 6, 60)

    def run(with_job, budget, mode="parrot"):
        job = AppParams(output_tokens=30, exact=True)
        jobs = mixed_jobs(chunks, num_chats=4, chat_interval_s=0.05, chat_params=PARAMS,
                          job_params=job, with_job=with_job)  # fmt: skip
        engine = sim_engine(num_pages=4096, model=LLAMA2_7B, latency_token_budget=budget)
        ex = ProgramExecutor(engine, ProgramConfig(mode=mode), tokenizer=TOK)
        results = run_jobs(ex, jobs)
        gaps = []
        for r in ex.records:
            if r["function"] == "chat":
                gaps.append((r["finish"] - r["first_token"]) / (r["output_tokens"] - 1))
        return max(gaps), [r for r in results if r.kind == "job"]

    alone, _ = run(False, 0)
    protected, job = run(True, 0)
    fcfs, _ = run(True, None, "request")
    assert protected <= alone * 1.001  # the chats never share a step with the job
    assert fcfs > alone * 1.05  # without criteria they do
    assert job and not job[0].errors


def test_bench_programs_script_on_the_simulator(tmp_path):
    out = tmp_path / "programs.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "scripts", "bench_programs.py"),
        "--device", "sim", "--model", "llama2-7b", "--dtype", "bfloat16",
        "--num_apps", "2", "--num_chunks", "3", "--chunk_tokens", "256", "--output_tokens", "16",
        "--variants", "request,dag,parrot,parrot-nocache,parrot-spread",
        "--mixed_variants", "chat-alone,fcfs,fcfs-b8,parrot-b0", "--num_chats", "3",
        "--chat_interval_s", "0.2", "--json_out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chain_summary" in proc.stdout and "mixed" in proc.stdout
    result = json.loads(out.read_text())
    chain = result["apps"]["chain_summary"]
    # No round trips: each of the chain's 2 dependent calls per app saves the 50 ms.
    assert chain["parrot"]["mean_latency_s"] < chain["request"]["mean_latency_s"] - 0.09
    assert chain["parrot-nocache"]["cached_tokens"] == 0 < chain["parrot"]["cached_tokens"]
    mixed = result["mixed"]
    alone = mixed["chat-alone"]["chat_tpot_p99_s"]
    assert mixed["parrot-b0"]["chat_tpot_p99_s"] <= alone * 1.001
    assert mixed["fcfs"]["chat_tpot_p99_s"] > alone * 1.01
    assert all(row["errors"] == 0 for app in result["apps"].values() for row in app.values())


@pytest.mark.slow
def test_apps_on_smollm2_equal_their_calls_one_by_one(smollm2_path):
    from llmjax import LLM

    llm = LLM(
        smollm2_path,
        max_model_len=768,
        num_pages=256,
        max_num_seqs=4,
        max_num_batched_tokens=128,  # few, small step shapes to compile
        compilation_cache_dir="",
    )
    chunks = document_chunks(llm.tokenizer, 2, 80, offset=64)
    params = AppParams(output_tokens=8, short_tokens=4)
    with Program(llm) as p:
        gets = map_reduce(p, chunks, params) + multi_agent(p, "a timer", 1, params)
        values = [v.get(c) for v, c in gets]
    assert all(v.strip() for v in values)
    ref = run_sequential(llm, p.functions, p.constants, p.calls)
    assert values == [ref[v.id][0] for v, _ in gets]
