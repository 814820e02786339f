"""The absl flags that scripts/generate.py and scripts/benchmark.py share for parallel runs:
--tp, --pp, --pad_heads, --balance_micro_batches, --check_lockstep and jax.distributed's
--coordinator_address, --num_processes, --process_id (one command per process; see
distributed.py)."""

from __future__ import annotations

from absl import flags


def define_flags() -> None:
    flags.DEFINE_integer("tp", 1, "Tensor-parallel devices (ParallelConfig.tp).")
    flags.DEFINE_integer("pp", 1, "Pipeline stages (ParallelConfig.pp).")
    flags.DEFINE_bool(
        "pad_heads",
        False,
        "Pad the kv heads with zero heads to a multiple of --tp when tp does not split them "
        "(e.g. SmolLM2's 3 kv heads at --tp 2).",
    )
    flags.DEFINE_bool(
        "balance_micro_batches",
        False,
        "With --pp > 1, cap each micro-batch at ceil(decoding requests / pp) decodes "
        "(SchedulerConfig.balance_micro_batches; Sarathi-Serve's rule takes every decode).",
    )
    flags.DEFINE_bool(
        "check_lockstep", False, "Multi-host debugging: compare sampled tokens across processes."
    )
    flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0, for a multi-process run."
    )
    flags.DEFINE_integer("num_processes", 1, "Processes in a multi-process run.")
    flags.DEFINE_integer("process_id", 0, "This process's index in a multi-process run.")


def initialize(values) -> None:
    """jax.distributed start-up from the flags (a no-op for one process)."""
    from llmjax.parallel.distributed import initialize as init

    init(values.coordinator_address, values.num_processes, values.process_id)


def llm_kwargs(values) -> dict:
    """The LLM(...) keyword arguments the flags set."""
    return dict(
        tp=values.tp,
        pp=values.pp,
        pad_heads=values.pad_heads,
        balance_micro_batches=values.balance_micro_batches,
        check_lockstep=values.check_lockstep,
    )


def is_leader(values) -> bool:
    """Whether this process prints and writes files (process 0)."""
    return values.process_id == 0
