"""The requests that scripts/benchmark.py's flags name: --workload (a generator of workloads.py
with its own flags, or --trace: llmjax's JSONL or Mooncake's), --qps, --num_requests, --seed.
`flags` is the script's parsed absl flags (scripts/simulate.py's are the same).
"""

from __future__ import annotations

from absl import app

PREFIX_WORKLOADS = ("shared_system_prompt", "few_shot", "multi_turn_chat")


def parse_qps(text: str) -> float:
    """--qps as requests/s ('inf': all at t=0)."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"--qps={text} must be > 0 or 'inf'")
    return value


def qps_given(flags) -> bool:
    """Whether --qps sets the arrivals (a trace keeps its own unless --qps is given)."""
    return flags.workload != "trace" or flags["qps"].present


def load_trace(flags) -> list | None:
    """The --trace file, checked before any engine is built (errors name the line); None for a
    Mooncake trace, whose token ids need the model's vocabulary (`mooncake_specs`)."""
    from llmjax.bench import workloads
    from llmjax.bench.mooncake import is_mooncake_trace

    if not flags.trace:
        raise app.UsageError("--workload=trace needs --trace=path.jsonl")
    try:
        if is_mooncake_trace(flags.trace):
            return None
        return workloads.load_trace(flags.trace)
    except (OSError, ValueError) as e:
        raise app.UsageError(f"bad --trace: {e}") from e


def mooncake_specs(flags, vocab_size: int, max_model_len: int) -> list:
    from llmjax.bench.mooncake import load_mooncake_trace

    try:
        return load_mooncake_trace(
            flags.trace,
            vocab_size=vocab_size,
            block_tokens=flags.mooncake_block_tokens,
            output_scale=flags.mooncake_output_scale,
            time_scale=flags.trace_time_scale,
            max_model_len=max_model_len,
            num_requests=flags.trace_requests,
            seed=flags.seed,
        )
    except (OSError, ValueError) as e:
        raise app.UsageError(f"bad --trace: {e}") from e


def build_specs(
    flags,
    qps: float,
    max_model_len: int,
    vocab_size: int,
    trace=None,
    *,
    retime_trace: bool = False,
    tokenizer=None,
):
    """The workload at `qps` (a trace keeps its own arrival times unless `retime_trace`)."""
    from llmjax.bench import workloads

    if flags.workload == "trace":
        if trace is None:  # Mooncake's
            trace = mooncake_specs(flags, vocab_size, max_model_len)
        return workloads.with_poisson_arrivals(trace, qps, flags.seed) if retime_trace else trace
    kwargs = dict(qps=qps, max_model_len=max_model_len, seed=flags.seed, scale=flags.scale)
    if flags.workload in PREFIX_WORKLOADS:
        kwargs |= dict(vocab_size=vocab_size, output_len=flags.output_len)
    question = {} if flags.question_len is None else {"question_len": flags.question_len}
    if flags.workload == "shared_system_prompt":
        kwargs |= dict(system_prompt_len=flags.system_prompt_len, **question)
    if flags.workload == "few_shot":
        kwargs |= dict(
            num_tasks=flags.num_tasks,
            num_shots=flags.num_shots,
            shot_len=flags.shot_len,
            **question,
        )
    if flags.workload == "multi_turn_chat":
        kwargs |= dict(
            num_turns=flags.num_turns,
            first_prompt_len=flags.first_prompt_len,
            user_turn_len=flags.user_turn_len,
            think_time=flags.think_time,
        )
    if flags.workload == "fixed":
        kwargs |= dict(prompt_len=flags.prompt_len, output_len=flags.output_len)
    if flags.workload == "long_context":
        kwargs |= dict(
            prompt_len=flags.long_prompt_len or 2048,
            output_len=flags.output_len,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
        )
    if flags.workload == "long_prompt_interference":
        kwargs |= dict(
            long_fraction=flags.long_fraction,
            decode_prompt_len=flags.prompt_len,
            decode_output_len=flags.output_len,
            long_prompt_len=flags.long_prompt_len,
            long_output_len=flags.long_output_len,
        )
    return workloads.make_workload(flags.workload, flags.num_requests, **kwargs)
