"""Who runs each step (`SchedulerConfig`) and how programs are served (`ProgramConfig`,
Parrot's global scheduler)."""

from __future__ import annotations

import dataclasses

from llmjax.config.checks import _check_positive

SCHEDULER_POLICIES = ("sarathi", "prefill_first", "decode_first", "splitfuse")
ADMISSION_ORDERS = ("fcfs", "lpm")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Who runs each step: the policy, and at most `max_num_seqs` requests and
    `max_num_batched_tokens` tokens (the token budget, Sarathi-Serve's chunk_size) per step.

    Policies (ALGORITHMS.md §3-4):
      sarathi        stall-free: decodes, then ongoing prefill chunks, then new prompts chunked to
                     the budget left (Sarathi-Serve). The default.
      prefill_first  vLLM's classic policy: whole new prompts in prefill-only steps that pause all
                     decodes; decode-only steps otherwise.
      decode_first   request-level batching (FasterTransformer): new requests join only when no
                     request is running.
      splitfuse      Dynamic SplitFuse (DeepSpeed-FastGen): decodes, then prompt pieces filling the
                     budget exactly; pages are taken per chunk.
    The whole-prompt policies need `max_num_batched_tokens >= max_model_len` (checked by
    EngineConfig).

    `admission_order` orders the admission of waiting requests (never the running ones, whose
    decodes and prefill chunks keep their stall-free priority; preempted requests stay first):
      fcfs  arrival order.
      lpm   SGLang's longest-prefix-match: most prefix-cached tokens first. Its guards: with more
            than `lpm_max_queue_len` (128) waiting it falls back to FCFS (matching every request
            each step costs too much); a request whose cache hit is at most
            `in_batch_prefix_len` (32) tokens but whose first `in_batch_prefix_len` tokens equal
            an earlier waiting request's goes last, so the earlier one fills the cache first.

    `latency_token_budget` (Parrot's LATENCY criteria inside Sarathi's budget, ALGORITHMS.md
    §13.5; None: off): while a request that a program tagged LATENCY (`ProgramHints`,
    llmjax/program/) runs, LATENCY requests are scheduled first and all other requests together
    get at most this many tokens of each step (decodes included; 0 pauses them), so their
    prefill chunks cannot stretch the latency requests' time between tokens. Requests without
    hints are scheduled as always.

    `balance_micro_batches` (pipeline parallelism only): cap each micro-batch's decodes at
    ceil(decoding requests / pp), so the decodes spread evenly over the pp micro-batches in
    flight. Off by default, as in Sarathi-Serve's code, where a micro-batch takes every decode
    not in flight: the split that the first admissions leave (say 6 + 2 decodes) then never
    changes, and every tick runs both stages at the size of the larger one.

    `fit_to_buckets` (the chunking policies, sarathi and splitfuse): a step is padded to its
    token bucket (`EngineConfig.token_buckets_per_octave`), and where work runs out below the
    budget, the step's last prefill chunk is cut down to the bucket below when that defers
    fewer tokens than the padding it saves (16 decodes + a 437-token chunk = 453 tokens, padded
    to 512, runs as 448 and leaves 5 tokens for the next step). The chunk cut is the last of its
    prompt (a chunk cut short by the budget leaves no padding), so its request's first token
    comes a step later: only steps cut down to `fit_min_tokens` tokens or more are cut, where
    the padding costs in proportion (below it a step's time hardly depends on its tokens).
    Off: the authors' chunking, every chunk as long as the budget and the prompt allow.
    """

    policy: str = "sarathi"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    admission_order: str = "fcfs"
    lpm_max_queue_len: int = 128
    in_batch_prefix_len: int = 32
    balance_micro_batches: bool = False
    latency_token_budget: int | None = None
    fit_to_buckets: bool = True
    fit_min_tokens: int = 128

    def __post_init__(self):
        _check_positive(
            self,
            "fit_min_tokens",
            "max_num_seqs",
            "max_num_batched_tokens",
            "lpm_max_queue_len",
            "in_batch_prefix_len",
        )
        if self.latency_token_budget is not None and not (
            isinstance(self.latency_token_budget, int) and self.latency_token_budget >= 0
        ):
            raise ValueError(
                f"latency_token_budget must be an integer >= 0 or None, got "
                f"{self.latency_token_budget=}"
            )
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"unknown {self.policy=}; choose one of {SCHEDULER_POLICIES}")
        if self.admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"unknown {self.admission_order=}; choose one of {ADMISSION_ORDERS}")

    @property
    def chunks_prefills(self) -> bool:
        return self.policy in ("sarathi", "splitfuse")


PROGRAM_MODES = ("parrot", "request")


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
    """How a `llmjax.program.ProgramExecutor` serves semantic-variable programs (Parrot, OSDI'24;
    ALGORITHMS.md §9.2). Names are Parrot's.

    `mode`: 'parrot' (the service receives the program's DAG: a call is dispatched as soon as
    its inputs are computed, under the policies below) or 'request' (the request-level
    baseline: the client awaits each call's output and then sends the calls that need it, so
    every dependent call waits `client_rtt_s` more (the round trip), and the engine sees plain
    requests with no criteria; the policies below are off).

    Parrot's global scheduler (each switchable):
      app_fifo     the ready queue is ordered by depth, deepest first (calls further along their
                   application go first), and the engine orders each application's requests by
                   the application's arrival (`ProgramHints.app_arrival_time`).
      graph_group  ready calls that feed a common consumer (the map stage of a map-reduce)
                   are dispatched together, to one engine, counted as one task against a
                   LATENCY cap.
      ctx_group    ready calls whose prompts share at least `ctx_min_tokens` leading tokens are
                   dispatched together (when graph_group does not group them).
      ctx_aware    among the engines that may take a group, one that holds its prompt's prefix
                   (at least `ctx_min_tokens` of it in its prefix cache, or dispatched there)
                   wins; then `placement` decides.
    `placement` among the engines that may take a group (after ctx_aware): 'pack' (Parrot's
    code: the lowest task cap first, so LATENCY tasks join engines already capped, then the
    least remaining token capacity, best fit) or 'spread' (the fewest tasks, then the most
    remaining token capacity: a load balancer, as the comment in Parrot's code describes it).
    Criteria (deduced back from each `get`): LATENCY calls carry `latency_tasks_num_upperbound`
    (4, Parrot's): an engine holding one takes at most that many tasks, so latency calls run in
    small batches; THROUGHPUT calls carry no cap. `latency_tokens_num_upperbound` (None: off)
    caps an engine holding a LATENCY call at that many prompt tokens the same way; Parrot's code
    sets 4096 in its annotation but never checks it, so by default it is not checked here
    either. An engine also takes at most `tasks_capacity` tasks and `tokens_capacity` prompt
    tokens (None: no task bound, and its KV cache's tokens), an empty engine any one task.
    `max_queue_size` ready calls wait at most (more fail the submission).
    """

    mode: str = "parrot"
    app_fifo: bool = True
    graph_group: bool = True
    ctx_group: bool = True
    ctx_aware: bool = True
    placement: str = "pack"
    latency_tasks_num_upperbound: int = 4
    latency_tokens_num_upperbound: int | None = None
    tasks_capacity: int | None = None
    tokens_capacity: int | None = None
    max_queue_size: int = 1024
    ctx_min_tokens: int = 128
    client_rtt_s: float = 0.0

    def __post_init__(self):
        if self.mode not in PROGRAM_MODES:
            raise ValueError(f"unknown {self.mode=}; choose one of {PROGRAM_MODES}")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"unknown {self.placement=}; choose 'pack' or 'spread'")
        _check_positive(
            self,
            "latency_tasks_num_upperbound",
            "latency_tokens_num_upperbound",
            "tasks_capacity",
            "tokens_capacity",
            "max_queue_size",
            "ctx_min_tokens",
        )
        if not self.client_rtt_s >= 0:
            raise ValueError(f"client_rtt_s must be >= 0, got {self.client_rtt_s=}")

    def replace(self, **changes) -> ProgramConfig:
        return dataclasses.replace(self, **changes)
