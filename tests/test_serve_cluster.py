"""The server in front of a cluster (llmjax/cluster/ behind llmjax/serve/): a prefill and a decode
instance on two fake CPU devices serve completions equal to one offline engine's, streamed and
not, and /metrics counts the cluster's tokens; two colocated instances run a program sent to
/v1/programs, placed by Parrot's scheduler, with the values of its calls run one by one. A real
uvicorn server on 127.0.0.1 at a free port; every call has a timeout."""

from llmjax import LLM, SamplingParams
from llmjax.cluster import InstanceSpec, launch
from llmjax.serve import Server
from tests.test_serve import _metrics, completion_token_ids

OPTS = dict(load_format="dummy", max_model_len=64, num_pages=32, page_size=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9, 10], list(range(20, 45))]


def test_a_disaggregated_cluster_serves_completions_equal_to_one_engine():
    want = LLM("tiny", **OPTS).generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    cluster = launch("tiny", InstanceSpec.parse("prefill,decode"), **OPTS)
    with Server(cluster) as server:
        assert server.model_name == "tiny"
        body = {"prompt": PROMPTS, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        ids, streamed = completion_token_ids(server, body)
        assert ids == [o.token_ids for o in want]
        assert streamed == ids
        metrics = _metrics(server)
        generated = [
            v for (name, _), v in metrics.items() if name.endswith("generation_tokens_total")
        ]
        assert generated and generated[0] == 2 * sum(len(o.token_ids) for o in want)
    assert cluster.transfer_stats.num_transfers == 2 * len(PROMPTS)
    assert not cluster.has_unfinished_requests()


def test_a_cluster_serves_programs_placed_on_its_instances():
    from llmjax.config import ProgramConfig
    from llmjax.program import Program, SemanticFunction
    from llmjax.program.reference import run_sequential
    from tests.program_helpers import ByteTokenizer

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    summarize = SemanticFunction("summarize", "Sum {{chunk}}:{{s}}", {"s": params})
    merge = SemanticFunction("merge", "{{a}}+{{b}}+{{c}}={{m}}", {"m": params})
    cluster = launch("tiny", InstanceSpec.parse("2xcolocated"), **OPTS)
    cluster.tokenizer = ByteTokenizer()  # for the program's text; the engines see token ids
    # spread, ungrouped: the three summaries go to the instances in turn
    config = ProgramConfig(placement="spread", graph_group=False, ctx_group=False)
    with Server(cluster, program_config=config) as server, Program(server.url) as program:
        parts = [summarize(chunk=c) for c in ("alpha", "beta", "gamma")]
        merged = merge(*parts)
        got = program.get([merged, *parts])
    assert all(s.num_prefill_tokens > 0 for s in cluster.stats)  # both instances served
    ref = run_sequential(
        LLM("tiny", **OPTS), program.functions, program.constants, program.calls, ByteTokenizer()
    )
    assert got == [ref[v.id][0] for v in (merged, *parts)]
