"""Workloads shared by the parallelism tests and their multi-process worker."""

import numpy as np

# Chunked prefill beside running decodes (budget 32 < prompts), prefix caching on.
ENGINE_OPTS = dict(
    load_format="dummy",
    page_size=4,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    max_model_len=128,
    scheduler_policy="sarathi",
    prefix_cache="radix",
    compilation_cache_dir="",
)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Random prompts, half of them sharing a 24-token prefix (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 256, 24).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(3, 256, int(rng.integers(4, 40))).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


# SmolLM2 on 8 fake devices (slow tests): chunked prefill beside decodes, a shared prefix.
SMOLLM2_OPTS = dict(max_model_len=160, max_num_batched_tokens=32, compilation_cache_dir="")
SMOLLM2_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The capital of France is a city where",  # shares a prefix with the first
]
SMOLLM2_MAX_TOKENS = 8


def compiled_step_hlo(llm, T: int = 16, S: int = 4, P: int = 8) -> str:
    """The optimized HLO of `llm`'s step for a T-token, S-sequence, P-page bucket (zero inputs:
    only the shapes matter), for tests that read its collectives."""
    from llmjax.engine.batch import SamplingInput
    from llmjax.model.step_input import StepInput

    step = StepInput(*(np.zeros(s, np.int32) for s in [T, T, T, S + 1, S, (S, P), 1, S]))
    z = np.zeros(S, np.float32)
    sampling = SamplingInput(
        z, z.astype(np.int32), z + 1, z.astype(np.uint32), z.astype(np.int32), all_greedy=False
    )
    return llm.engine.runner.lower(step, sampling).compile().as_text()
