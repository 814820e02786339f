"""The prefill process of tests/test_cluster_transfer_server.py's two-process tests: builds a
prefill-role tiny engine (dummy weights, the same as the test's), prefills PROMPT until the
request parks, offers its KV through the transfer-server transport and prints the offer, then
waits for the parent on stdin.

    python tests/transfer_server_worker.py

stdout: 'OFFER <base64 pickle of (MigratedRequest, Offer)>', then 'RELEASED' after the parent
wrote 'release' (the worker then exits 0); it also exits when stdin closes.
"""

import base64
import pickle
import sys

OPTS = dict(
    load_format="dummy",
    page_size=4,
    max_model_len=64,
    num_pages=32,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    compilation_cache_dir="",
)
PROMPT = [7, 21, 3, 99, 150, 42, 8, 250, 31, 64, 5, 17, 200]  # 13 tokens: a partial last page
MAX_TOKENS = 8


def main() -> None:
    import jax

    from llmjax import LLM, SamplingParams
    from llmjax.cluster.transfer_server import TransferServerTransport

    llm = LLM("tiny", role="prefill", devices=[jax.devices()[0]], **OPTS)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "r")
    while not engine.parked:
        engine.step()
    m, pages = engine.export_request("r")
    transport = TransferServerTransport()
    offer = transport.offer(engine.runner, "r", pages)
    print("OFFER " + base64.b64encode(pickle.dumps((m, offer))).decode(), flush=True)
    for line in sys.stdin:
        if line.strip() == "release":
            transport.release(offer)
            engine.release_request("r")
            print("RELEASED", flush=True)
            return


if __name__ == "__main__":
    main()
