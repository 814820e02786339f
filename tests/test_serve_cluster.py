"""The server in front of a cluster (llmjax/cluster/ behind llmjax/serve/): a prefill and a decode
instance on two fake CPU devices serve completions equal to one offline engine's, streamed and
not, and /metrics counts the cluster's tokens. A real uvicorn server on 127.0.0.1 at a free port;
every call has a timeout."""

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
