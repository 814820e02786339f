"""Long-document summarization, two ways (Parrot §8's chain and map-reduce summarization).

chain_summary: refine: summary_1 = summarize(chunk_1); summary_i = refine(summary_{i-1},
    chunk_i). Each call waits for the previous one: a request-level client pays a round trip
    per chunk, while the DAG lets the service start each call the moment its input exists.
map_reduce: summary_i = summarize(chunk_i) for every chunk (independent: the map stage), then one
    reduce over all of them. The map calls share a consumer (Parrot's graph grouping dispatches
    them together) and the template's prefix (shared KV pages in the radix cache).
"""

from __future__ import annotations

from llmjax.program.apps.common import DEFAULT, AppParams
from llmjax.program.function import SemanticFunction

SYSTEM = "You are a careful editor who writes short, faithful summaries."


def summarize_fn(params: AppParams) -> SemanticFunction:
    return SemanticFunction(
        "summarize",
        "Summarize the following passage in two sentences.\n\nPassage:\n{{chunk}}{{summary}}",
        {"summary": params.sampling()},
        chat=True,
        system=SYSTEM,
    )


def refine_fn(params: AppParams) -> SemanticFunction:
    return SemanticFunction(
        "refine",
        "Here is a summary of a story so far:\n{{summary}}\n\nRefine it with the next passage, "
        "in at most three sentences.\n\nNext passage:\n{{chunk}}{{refined}}",
        {"refined": params.sampling()},
        chat=True,
        system=SYSTEM,
    )


def reduce_fn(params: AppParams, n: int) -> SemanticFunction:
    parts = "\n".join(f"{i + 1}. {{{{s{i}}}}}" for i in range(n))
    return SemanticFunction(
        f"reduce_{n}",
        f"Combine these {n} section summaries into one summary of the whole story.\n\n"
        f"{parts}{{{{summary}}}}",
        {"summary": params.sampling()},
        [f"s{i}" for i in range(n)],
        chat=True,
        system=SYSTEM,
    )


def chain_summary(program, chunks: list[str], params: AppParams = DEFAULT):
    """[(final summary, 'latency')]: the refine chain over `chunks` (inside `with program`)."""
    summary = summarize_fn(params)(chunk=chunks[0])
    refine = refine_fn(params)
    for chunk in chunks[1:]:
        summary = refine(summary=summary, chunk=chunk)
    return [(summary, "latency")]


def map_reduce(program, chunks: list[str], params: AppParams = DEFAULT, criteria="latency"):
    """[(final summary, criteria)]: a summary per chunk, then one reduce over them."""
    summarize = summarize_fn(params)
    summaries = [summarize(chunk=c) for c in chunks]
    final = reduce_fn(params, len(summaries))(*summaries)
    return [(final, criteria)]
