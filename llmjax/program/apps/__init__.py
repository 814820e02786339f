"""Applications written as semantic-variable programs (Parrot's evaluation apps, ALGORITHMS.md
§9.3), used by the tests, scripts/bench_programs.py and colab/07_programs.ipynb.

    chain_summary(program, chunks)        refine a running summary chunk by chunk (a chain)
    map_reduce(program, chunks)           summarize every chunk, then one reduce (fan-out, fan-in)
    multi_agent(program, task)            roles sharing a long system prompt: plan, parallel
                                          work, reviews, a final report (MetaGPT-like)
    mixed.py                              a chat stream at a fixed rate beside a map-reduce job

Each builder takes a `Program` (inside `with program:`) and returns the variables to `get` with
their criteria; `document_chunks` cuts the bundled public-domain text into token windows.
`AppParams` sets the output lengths (and, for the simulator, `ignore_eos` with no stop strings,
so outputs have their nominal length).
"""

from llmjax.program.apps.common import AppParams, document_chunks
from llmjax.program.apps.multi_agent import multi_agent
from llmjax.program.apps.summarize import chain_summary, map_reduce

APPS = {
    "chain_summary": chain_summary,
    "map_reduce": map_reduce,
    "multi_agent": multi_agent,
}

__all__ = ["APPS", "AppParams", "chain_summary", "document_chunks", "map_reduce", "multi_agent"]
