"""One process of a multi-host run (started by tests/test_parallel.py, two at a time on
127.0.0.1): joins jax.distributed, serves fixed prompts with the tiny model sharded over both
processes' devices (tensor parallel, or one pipeline stage per process), with the lockstep check
on, and writes its outputs as JSON.

    python tests/multihost_worker.py ADDRESS NUM_PROCESSES PROCESS_ID TP PP OUT_JSON [MODEL EP]

MODEL: a tiny HF checkpoint's directory (its weights, not dummy ones), with EP expert parallelism
for a mixture of experts (its all-to-alls then cross the processes).
"""

import json
import sys


def main(
    address: str,
    num_processes: int,
    process_id: int,
    tp: int,
    pp: int,
    out_path: str,
    model: str = "tiny",
    ep: int = 1,
) -> None:
    from llmjax.parallel.distributed import initialize

    initialize(address, num_processes, process_id)
    import jax

    from llmjax import LLM, SamplingParams
    from tests.parallel_cases import ENGINE_OPTS, prompts

    opts = dict(ENGINE_OPTS)
    if model != "tiny":
        del opts["load_format"]
    llm = LLM(model, tp=tp, pp=pp, ep=ep, check_lockstep=True, **opts)
    outs = llm.generate(prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
    with open(out_path, "w") as f:
        json.dump(
            {
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "global_devices": jax.device_count(),
                "token_ids": [o.token_ids for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
            },
            f,
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    addr, n, pid, tp, pp, out = sys.argv[1:7]
    rest = sys.argv[7:]
    main(addr, int(n), int(pid), int(tp), int(pp), out, *rest[:1], *map(int, rest[1:2]))
