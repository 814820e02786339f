"""A request's state as the `RequestOutput` the engine emits (text decoded once it finishes)."""

from __future__ import annotations

import dataclasses

from llmjax.engine.request import Request, RequestOutput, cached_tokens_per_tier


def request_output(req: Request, tokenizer=None) -> RequestOutput:
    """`req` as an output: its tokens so far; once it finished, its text (cut at a stop
    string) and its logprob entries with each token's text."""
    done = req.status.is_done
    text = ""
    if done and tokenizer is not None and req.output_token_ids:
        text = tokenizer.decode(req.output_token_ids)
        if req.stop_matcher is not None and req.stop_matcher.text_end is not None:
            text = text[: req.stop_matcher.text_end]
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=text,
        finished=done,
        finish_reason=req.finish_reason,
        metrics=req.metrics,
        num_cached_tokens=req.num_cached_tokens,
        error=req.error,
        stop_reason=req.stop_reason,
        num_cached_tokens_per_tier=cached_tokens_per_tier(req.num_cached_tokens, req.loaded_tokens),
        logprobs=_decoded_logprobs(req.logprobs, tokenizer) if done else _copy(req.logprobs),
        cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
        prompt_logprobs=_decoded_logprobs(req.prompt_logprobs, tokenizer) if done else None,
        weight_version=req.weight_version,
    )


def _decoded_logprobs(entries, tokenizer):
    """Logprob entries with each token's text (a tokenizer's), for a finished output."""
    if entries is None or tokenizer is None:
        return None if entries is None else list(entries)

    def decoded(e):
        if e is None:
            return None
        return {
            t: dataclasses.replace(lp, decoded_token=tokenizer.decode([t], False))
            for t, lp in e.items()
        }

    return [decoded(e) for e in entries]


def _copy(items: list | None) -> list | None:
    return None if items is None else list(items)
