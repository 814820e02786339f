"""Log probabilities in OpenAI's two wire formats (vLLM's, for the same requests).

Completions (legacy): `{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: lp}],
"text_offset": [...]}`, the sampled token among the top entries (up to logprobs + 1 of them);
with `echo`, the prompt's tokens first (the first prompt token's logprob and top entries null).
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`, `top_logprobs` the k most likely. A token is its text (the tokenizer's decoding of
it alone), or "token_id:N" without a tokenizer. `entries` are the engine's {token id: Logprob}
per position (llmjax/engine/request.py).
"""

from __future__ import annotations

from collections.abc import Sequence

FLOOR = -9999.0  # JSON has no -inf: vLLM's floor for a masked token's log probability


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _lp(value: float) -> float:
    return max(float(value), FLOOR)


def _ranked(entry: dict, k: int) -> list:
    return sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]


def completion_logprobs(
    tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[dict | None],
    text_offset: int = 0,
) -> dict:
    """The legacy completions `logprobs` of `token_ids` (their `entries`), offsets from
    `text_offset` (the echoed prompt's or earlier chunks' length)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(tokenizer, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:  # the first prompt token: nothing before it
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_lp(entry[token].logprob))
        top.append({token_text(tokenizer, t): _lp(lp.logprob) for t, lp in entry.items()})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[dict], k: int) -> dict:
    """The chat completions `logprobs` of `token_ids`, with `k` top alternatives each."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(tokenizer, token)
        content.append(
            {
                "token": text,
                "logprob": _lp(entry[token].logprob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (alt := token_text(tokenizer, t)),
                        "logprob": _lp(lp.logprob),
                        "bytes": list(alt.encode("utf-8")),
                    }
                    for t, lp in _ranked(entry, k)
                ],
            }
        )
    return {"content": content}
