"""A mixed workload (Parrot §8's mixed latency- and throughput-sensitive applications): a chat
stream, one single-call program every `chat_interval_s` fetched with criteria 'latency', while a
map-reduce summarization job over `num_chunks` chunks runs in the background, fetched with
criteria 'throughput'. `mixed_jobs` returns the recorded jobs for `run_jobs`
(llmjax/program/workload.py): the job arrives at `job_arrival_s`, the chats from 0 on.
"""

from __future__ import annotations

from llmjax.program.apps.common import DEFAULT, AppParams
from llmjax.program.apps.summarize import map_reduce
from llmjax.program.function import SemanticFunction
from llmjax.program.workload import Job, record

QUESTIONS = [
    "What is a good way to learn a new language?",
    "Give me three ideas for a rainy afternoon.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "What should I pack for a weekend hike?",
    "Explain what a compiler does.",
    "Suggest a name for a small bakery.",
    "How can I sleep better?",
]


def chat_fn(params: AppParams) -> SemanticFunction:
    return SemanticFunction(
        "chat", "{{question}}{{answer}}", {"answer": params.sampling()}, chat=True
    )


def mixed_jobs(
    chunks: list[str],
    *,
    num_chats: int = 8,
    chat_interval_s: float = 2.0,
    job_arrival_s: float = 0.0,
    chat_params: AppParams = DEFAULT,
    job_params: AppParams = DEFAULT,
    with_chats: bool = True,
    with_job: bool = True,
) -> list[Job]:
    """The chat programs ('chat-i', kind 'chat') and the job ('job', kind 'job')."""
    jobs = []
    if with_job:
        jobs.append(
            record(
                "job",
                lambda p: map_reduce(p, chunks, job_params, criteria="throughput"),
                job_arrival_s,
                "job",
            )
        )
    if with_chats:
        ask = chat_fn(chat_params)
        for i in range(num_chats):
            q = QUESTIONS[i % len(QUESTIONS)]
            jobs.append(
                record(
                    f"chat-{i}",
                    lambda p, q=q: [(ask(question=q), "latency")],
                    i * chat_interval_s,
                    "chat",
                )
            )
    return jobs
