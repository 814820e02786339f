"""`Request` (engine-side state of one request) and `RequestOutput` (what the user gets back)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from llmjax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmjax.lora import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED)


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (seconds on the engine's clock, llmjax/engine/clock.py: time.perf_counter for
    a real engine) from which TTFT, TBT, TPOT and latency follow."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    # With speculative decoding: the request's counters (llmjax/engine/speculative.py's
    # SpecState: proposals verified and accepted, tokens per decode step)
    spec_decode: object | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def scheduling_delay(self) -> float | None:
        """Arrival to the first time the request was scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tbt(self) -> list[float]:
        """Time between consecutive generated tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Per-request mean gap after the first token: (t_last - t_first) / (n_out - 1); 0 for a
        single token (DistServe's definition)."""
        if not self.token_times:
            return None
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


LATENCY, THROUGHPUT = "latency", "throughput"  # Parrot's performance criteria


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log probability under the model's raw distribution at one position, its rank
    there (1 = the most likely) and its text (vLLM's `Logprob`; text only with a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True)
class ProgramHints:
    """What a program's executor (llmjax/program/, Parrot) tells the engine about one of its
    requests; requests without hints are scheduled as always.

    app_id: the program (application) it belongs to.
    criteria: 'latency', 'throughput' or None, deduced back from the program's `get`. With
        `SchedulerConfig.latency_token_budget` set, a running 'latency' request goes first and
        caps the other requests' tokens per step (llmjax/engine/scheduler.py).
    app_arrival_time: when given (Parrot's app-level FIFO), the engine orders the request by
        its application's arrival (then its own) instead of its own arrival: running order,
        preemption victims (the youngest application first) and FCFS admission.
    depth: its distance from the program's inputs (1 + the deepest of its inputs'), for
        logs and plots."""

    app_id: str
    criteria: str | None = None
    app_arrival_time: float | None = None
    depth: int = 0

    def __post_init__(self):
        if self.criteria not in (None, LATENCY, THROUGHPUT):
            raise ValueError(f"criteria must be 'latency', 'throughput' or None: {self.criteria!r}")


# The token id a pending token's position holds on the host (the device fills in the real one).
PENDING_TOKEN = -1


@dataclasses.dataclass
class Request:
    """A request as the scheduler sees it.

    `num_computed_tokens` counts tokens whose K/V is in the cache; the tokens still to compute are
    `all_token_ids[num_computed_tokens:]` (a prompt, its rest after a chunk, or the last generated
    token). After a preemption `num_computed_tokens` drops to 0 and the generated tokens are kept,
    so recomputation covers prompt + output so far.

    With async scheduling (llmjax/engine/overlap.py) `num_pending_tokens` counts tokens sampled
    by a step still on the device: they count in `num_tokens` (and their positions read as
    `PENDING_TOKEN` in `token_ids_slice`) but are not in `output_token_ids` until the step is
    collected (`Scheduler.update`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int
    prompt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    # of those, the ones loaded from a lower KV tier (llmjax/engine/kv_tiers.py), per tier name
    loaded_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it
    metrics: RequestMetrics = dataclasses.field(
        default_factory=lambda: RequestMetrics(arrival_time=time.perf_counter())
    )
    # Set by the engine when sampling_params.stop is given (a StopStringMatcher).
    stop_matcher: object | None = dataclasses.field(default=None, repr=False)
    hints: ProgramHints | None = None  # from a program's executor (llmjax/program/)
    # With sampling_params.logprobs: per generated token, {token id: Logprob} (the top ones and
    # the sampled one), and the sum of the sampled tokens' log probabilities.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    # With sampling_params.prompt_logprobs: None for the first prompt token, then per prompt
    # token {token id: Logprob} (the top ones and the actual one), filled as chunks compute.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With sampling_params.structured_outputs: its llguidance matcher (engine/structured.py),
    # fed each generated token; the request stops when the grammar is complete.
    matcher: object | None = dataclasses.field(default=None, repr=False)
    num_pending_tokens: int = 0  # sampled on the device, not yet on the host (async scheduling)
    weight_version: int = 0  # the engine's weight version that made its last token
    lora_request: LoRARequest | None = None  # its LoRA adapter (llmjax/lora/); None: the base

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def cache_namespace(self) -> bytes | None:
        """The prefix cache's tree its pages belong to: its adapter's (None: the base model's)."""
        return None if self.lora_request is None else self.lora_request.cache_namespace

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones included (what max_tokens and the sampler's
        counters count)."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def needs_host_tokens(self) -> bool:
        """Whether its next step needs its newest token on the host: a structured output's
        bitmask, or penalties over the generated tokens."""
        return self.matcher is not None or self.sampling_params.has_penalties

    @property
    def is_latency(self) -> bool:
        """Tagged LATENCY by a program (Parrot's criteria): see ProgramHints."""
        return self.hints is not None and self.hints.criteria == LATENCY

    @property
    def priority_time(self) -> float:
        """The time FCFS orders it by: its application's arrival (ProgramHints), else its own."""
        h = self.hints
        if h is not None and h.app_arrival_time is not None:
            return h.app_arrival_time
        return self.metrics.arrival_time

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without concatenating prompt and output; a pending
        token's position (async scheduling) reads `PENDING_TOKEN`."""
        n = len(self.prompt_token_ids)
        if start >= n:
            ids = self.output_token_ids[start - n : end - n]
        elif end <= n:
            return self.prompt_token_ids[start:end]
        else:
            ids = self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
        if self.num_pending_tokens and len(ids) < end - start:
            ids = ids + [PENDING_TOKEN] * min(end - start - len(ids), self.num_pending_tokens)
        return ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int, now: float) -> None:
        """Record a generated token and finish the request if it hit a stop condition."""
        self.output_token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)
        params = self.sampling_params
        if self.matcher is not None:
            from llmjax.engine.grammar import StructuredOutputs

            ended = StructuredOutputs.advance(self.matcher, token_id)
            if ended == "stop":  # the grammar is complete (with EOS or not)
                self.finish("stop", now)
                return
            if ended not in (None, "stop"):
                self.error = ended
                self.finish("error", now, RequestStatus.REJECTED)
                return
        if token_id in params.stop_token_ids:
            self.stop_reason = token_id
            self.finish("stop", now)
        elif (not params.ignore_eos and token_id in self.eos_token_ids) or (
            self.stop_matcher is not None and self.stop_matcher.add(token_id)
        ):
            if self.stop_matcher is not None and self.stop_matcher.matched is not None:
                self.stop_reason = self.stop_matcher.matched
            self.finish("stop", now)
        elif len(self.output_token_ids) >= params.max_tokens:
            self.finish("length", now)

    def finish(self, reason: str, now: float, status: RequestStatus = RequestStatus.FINISHED):
        self.status = status
        self.finish_reason = reason
        self.metrics.finished_time = now


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (vLLM's `CompletionOutput`): `index` among its n samples, its
    text and token ids, why it ended (None while it runs), and its logprobs if asked."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """The result of one request (names as in vLLM).

    `text` is the detokenized `token_ids` (generated tokens only; cut before a matched stop
    string unless include_stop_str_in_output). `finish_reason` is 'stop' (EOS, a stop token or a
    stop string), 'length' (max_tokens or max_model_len), 'abort', or 'error' with
    `error` saying why (e.g. a prompt too long for the model). `num_cached_tokens` is the prompt
    tokens whose KV came from the prefix cache instead of being computed (its hit);
    `num_cached_tokens_per_tier` splits it by where the KV was found: 'device' (the radix
    cache's pages) and each lower KV tier it was loaded from ('host', 'disk', 'mooncake';
    llmjax/engine/kv_tiers.py).
    `stop_reason` (as vLLM's): the stop string or the stop token id that ended the request; None
    for EOS and every other reason. With `SamplingParams.logprobs` = k: `logprobs`, per
    generated token, {token id: Logprob} for the k most likely tokens and the sampled one
    (log-softmax of the model's raw logits), and `cumulative_logprob`, the sampled tokens' sum;
    with `prompt_logprobs` = k, `prompt_logprobs`: None for the first prompt token, then the same
    for each prompt token given the ones before it (on the finished output).

    `outputs`: the request's samples as vLLM's `CompletionOutput`s, n of them with
    `SamplingParams.n` (the top-level text, token ids, finish reason and logprobs are the
    first's); `finished` once all are.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens_per_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)
    weight_version: int = 0  # the weight version that made its last token (LLM.update_weights)

    def __post_init__(self):
        if not self.outputs:  # one sample: the top-level fields are it
            self.outputs = [
                CompletionOutput(
                    0,
                    self.text,
                    self.token_ids,
                    self.finish_reason,
                    self.stop_reason,
                    self.logprobs,
                    self.cumulative_logprob,
                )
            ]


def cached_tokens_per_tier(num_cached_tokens: int, loaded_tokens: dict[str, int]) -> dict:
    """A request's cache hit by tier: the loaded tokens per lower tier, the rest 'device'."""
    loaded = {k: v for k, v in loaded_tokens.items() if v}
    return {"device": max(0, num_cached_tokens - sum(loaded.values())), **loaded}


@dataclasses.dataclass
class MigratedRequest:
    """A request between instances (DistServe's unit of migration): everything a decode
    instance needs besides the KV pages of its first `num_kv_tokens` tokens. Plain data (it
    pickles, for Ray's control plane); `metrics` keeps the timestamps stamped so far on the
    source's clock."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token (and any after it)
    sampling_params: SamplingParams
    seed: int
    num_kv_tokens: int  # tokens whose KV the moved pages hold (the prompt after prefill)
    metrics: RequestMetrics
    prompt: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    loaded_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    hints: ProgramHints | None = None
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None
    lora_request: LoRARequest | None = None  # its adapter: the destination serves it too

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def num_kv_pages(self, page_size: int) -> int:
        return -(-self.num_kv_tokens // page_size)
