"""What the engine checks of a request before it queues it (`LLMEngine.validate_request`)."""

from __future__ import annotations

from llmjax.config import EngineConfig
from llmjax.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A request the engine can never run; `param` names what is wrong with it: 'prompt'
    (empty, too long, ids outside the vocabulary), 'max_tokens' (prompt + max_tokens need more
    KV pages than the cache has), 'stop' (stop strings without a tokenizer) or 'lora_request'
    (an adapter the engine cannot serve)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles (a Ray actor's error crosses processes)
        return type(self), (str(self), self.param)


def check_request(engine, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
    """Raise InvalidRequest if this request could never run on `engine` (`LLMEngine`: its
    config, role, tokenizer and block manager, all fixed when it is built)."""
    n = len(prompt_token_ids)
    max_len = engine.config.max_model_len
    if n == 0:
        raise InvalidRequest("empty prompt: at least one token is needed", "prompt")
    if sampling_params.stop and engine.tokenizer is None:
        raise InvalidRequest(
            "stop strings need a tokenizer; this engine has none (use stop_token_ids)", "stop"
        )
    if n >= max_len:
        raise InvalidRequest(
            f"prompt has {n} tokens but max_model_len={max_len} leaves no room for a new token",
            "prompt",
        )
    vocab = engine.config.model.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt"
        )
    _validate_processing(engine.config, sampling_params)
    spec = sampling_params.structured_outputs
    if spec is not None:
        if engine.tokenizer is None or engine.config.device == "sim":
            why = "a tokenizer" if engine.tokenizer is None else "real logits (not simulated)"
            raise InvalidRequest(f"structured_outputs need {why}", "structured_outputs")
        try:
            engine.structured.check(spec)
        except (ValueError, ImportError) as e:
            raise InvalidRequest(str(e), "structured_outputs") from None
    if sampling_params.n > 1 and engine.role != "colocated":
        raise InvalidRequest(
            f"n={sampling_params.n} on a {engine.role} instance: samples run on colocated "
            "engines (disaggregated n is not supported yet)",
            "n",
        )
    # Alone in the cache, the request must be able to reach its last token.
    total = min(n + sampling_params.max_tokens, max_len)
    need = engine.block_manager.pages_to_hold(n, total)
    if need > engine.block_manager.num_usable_pages:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens needs {need} KV pages for {total} tokens but "
            f"the whole cache has {engine.block_manager.num_usable_pages}; raise num_pages or "
            "lower max_tokens",
            "max_tokens",
        )


def _validate_processing(cfg: EngineConfig, params: SamplingParams) -> None:
    """What this engine can do of logits processing, logprobs and n."""
    from llmjax.engine.batch import MAX_BIAS_SLOTS

    logprobs = params.logprobs is not None or params.prompt_logprobs is not None
    if not (params.processes_logits or logprobs):
        return
    if cfg.device == "sim" and logprobs:
        raise InvalidRequest(
            "logprobs: the simulated device computes no logits (its tokens are stand-ins)",
            "logprobs" if params.logprobs is not None else "prompt_logprobs",
        )
    if cfg.parallel.pp > 1 or cfg.sparse_kv.enabled:
        what = "pp > 1" if cfg.parallel.pp > 1 else f"sparse_kv={cfg.sparse_kv.mode!r}"
        raise InvalidRequest(
            f"logits processing and logprobs are not supported with {what} yet (penalties, "
            "logit_bias, min_tokens, min_p and logprobs run in the sampler of dense "
            "single-stage engines)",
            "logprobs" if params.logprobs is not None else "logit_bias",
        )
    slots = len(params.logit_bias)
    if params.min_tokens:
        slots += len(set(params.stop_token_ids) | set(cfg.model.eos_token_ids))
    if slots > MAX_BIAS_SLOTS:
        raise InvalidRequest(
            f"logit_bias and min_tokens' stop tokens need {slots} bias slots; at most "
            f"{MAX_BIAS_SLOTS}",
            "logit_bias",
        )
