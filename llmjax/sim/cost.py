"""What a step costs: its features, read off the packed `StepInput`, and cost models over them.

The features are the ones Vidur's and DistServe's latency models use (ALGORITHMS.md §12.1,
§7.2): token-level work is linear in the step's tokens; prefill attention grows with the sum
over prefill chunks of chunk_len x context_len; decode attention with the decode batch and the
sum of its contexts; plus a per-step constant. Two more are llmjax's own: a jitted step runs at
its padded bucket shape (`llmjax/engine/batch.py`: T tokens rounded up to a power of two, S =
min(T, max_num_seqs) sequence rows, each through the LM head), so what it costs on a real device
follows `padded_tokens` and `padded_seqs` as much as the real tokens (measured on this CPU: a
122-token prefill in a T=128, S=64 bucket takes 155 ms, a fit without them predicts 119). A
model predicts seconds from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

FEATURES = (
    "constant",  # 1 per step
    "tokens",  # new tokens in the step (prefill chunks + decodes): the token-level operators
    "prefill_attention",  # sum over prefill chunks of chunk_len x kv_len (keys they attend)
    "decodes",  # sequences with one new token (DistServe's batch-size term)
    "decode_context",  # sum of the decodes' kv_len
    "padded_tokens",  # T, the step's token bucket
    "padded_seqs",  # S, its sequence rows (each through the LM head)
)


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """One step's cost features (FEATURES), from its real (unpadded) sequences, and three more
    that the analytic model (llmjax/sim/roofline.py) reads: `prefill_pairs`, the causal
    (query, key) pairs of the prefill chunks (sum of chunk_len x kv_len - chunk_len x
    (chunk_len - 1) / 2); `prefill_context`, the keys the chunks read (sum of their kv_len);
    `seqs`, the sequences; `padded_tokens` and `padded_seqs`, the bucket (T, S) the step ran at
    (the last two are FEATURES too); and `spans`, each sequence's (new tokens, kv_len), from
    which `in_window` gives a sliding-window layer's features."""

    tokens: int
    prefill_attention: int
    decodes: int
    decode_context: int
    prefill_pairs: int = 0
    prefill_context: int = 0
    seqs: int = 0
    padded_tokens: int = 0
    padded_seqs: int = 0
    spans: tuple[tuple[int, int], ...] = dataclasses.field(default=(), repr=False)

    def in_window(self, window: int | None) -> StepFeatures:
        """The attention features of a layer whose tokens see only the last `window` keys
        (Gemma's local layers): each decode reads min(kv_len, window) keys, a chunk's token at
        position p attends min(p + 1, window) and the chunk reads min(kv_len, chunk + window - 1).
        Unchanged without a window, or without `spans` (features built by hand)."""
        if window is None or not self.spans:
            return self

        def causal(n):  # sum over positions 0..n-1 of min(p + 1, window)
            if n <= window:
                return n * (n + 1) // 2
            return window * (window + 1) // 2 + (n - window) * window

        pairs = attention = context = decode_context = 0
        for q, kv in self.spans:
            if q == 1:
                decode_context += min(kv, window)
            elif q > 1:
                read = min(kv, q + window - 1)
                pairs += causal(kv) - causal(kv - q)
                attention += q * read
                context += read
        return dataclasses.replace(
            self,
            prefill_attention=attention,
            decode_context=decode_context,
            prefill_pairs=pairs,
            prefill_context=context,
        )

    @classmethod
    def from_step(cls, step) -> StepFeatures:
        n = int(np.asarray(step.num_seqs).reshape(-1)[0])
        cu = np.asarray(step.cu_q_lens, np.int64)[: n + 1]
        q = np.diff(cu)
        kv = np.asarray(step.kv_lens, np.int64)[:n]
        prefill = q > 1
        qp, kvp = q[prefill], kv[prefill]
        return cls(
            tokens=int(q.sum()),
            prefill_attention=int((qp * kvp).sum()),
            decodes=int((q == 1).sum()),
            decode_context=int(kv[q == 1].sum()),
            prefill_pairs=int((qp * kvp - qp * (qp - 1) // 2).sum()),
            prefill_context=int(kvp.sum()),
            seqs=n,
            padded_tokens=len(step.token_ids),
            padded_seqs=len(step.kv_lens),
            spans=tuple(zip(q.tolist(), kv.tolist(), strict=True)),
        )

    def vector(self) -> np.ndarray:
        """[len(FEATURES)] float64, in FEATURES' order."""
        return np.array(
            [1.0, self.tokens, self.prefill_attention, self.decodes, self.decode_context,
             self.padded_tokens, self.padded_seqs],
            np.float64,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LinearCostModel:
    """seconds = coefficients . features (FEATURES' order), at least `min_seconds`. Fewer
    coefficients than features are the first ones (the rest 0: e.g. a model of unpadded work)."""

    coefficients: tuple[float, ...]
    min_seconds: float = 0.0

    def __post_init__(self):
        if not 1 <= len(self.coefficients) <= len(FEATURES):
            raise ValueError(
                f"{len(self.coefficients)} coefficients for {len(FEATURES)} features {FEATURES}"
            )
        padded = tuple(self.coefficients) + (0.0,) * (len(FEATURES) - len(self.coefficients))
        object.__setattr__(self, "coefficients", tuple(float(c) for c in padded))
        if not all(np.isfinite(self.coefficients)):
            raise ValueError(f"coefficients must be finite: {self.coefficients}")

    def step_seconds(self, features: StepFeatures) -> float:
        return max(self.min_seconds, float(np.dot(self.coefficients, features.vector())))

    @classmethod
    def fit(cls, features: Sequence[StepFeatures], seconds: Sequence[float]) -> LinearCostModel:
        """Least squares over measured steps (Vidur's and DistServe's fitted form). Features a
        sample never varies (e.g. no prefill at all) get coefficient 0. Predictions are floored
        at the fastest measured step: with few, noisy steps the fit can otherwise extrapolate a
        step to zero or negative time."""
        if len(features) != len(seconds) or not len(features):
            raise ValueError(f"{len(features)} feature rows for {len(seconds)} step times")
        X = np.stack([f.vector() for f in features])
        y = np.asarray(seconds, np.float64)
        used = np.ptp(X, axis=0) > 0
        used[0] = True  # the constant
        scale = np.abs(X[:, used]).max(axis=0)  # columns of one magnitude, for the solver
        coef = np.zeros(len(FEATURES))
        coef[used] = np.linalg.lstsq(X[:, used] / scale, y, rcond=None)[0] / scale
        return cls(tuple(float(c) for c in coef), min_seconds=float(y.min()))

    @classmethod
    def from_profile(cls, path: str) -> LinearCostModel:
        """The model `scripts/profile_step.py` fitted (its JSON), refitted on all its steps."""
        import json

        with open(path) as f:
            profile = json.load(f)
        names = tuple(profile.get("features", ()))
        if not names or names != FEATURES[: len(names)]:
            raise ValueError(f"{path}: features {profile.get('features')} are not {FEATURES}")
        steps = profile["steps"]
        return cls.fit(
            [StepFeatures(**s["features"]) for s in steps], [s["seconds"] for s in steps]
        )

    def relative_error(self, features: Sequence[StepFeatures], seconds: Sequence[float]) -> float:
        """Mean |predicted - measured| / measured over held-out steps."""
        pred = np.array([self.step_seconds(f) for f in features])
        y = np.asarray(seconds, np.float64)
        return float(np.mean(np.abs(pred - y) / y))


class RecordedCostModel:
    """Replays recorded step durations in order (a real run's, to drive the simulated engine
    through the same timeline); raises when they run out."""

    def __init__(self, seconds: Sequence[float]):
        self._seconds = list(seconds)
        self._next = 0

    def step_seconds(self, features: StepFeatures) -> float:
        del features
        if self._next >= len(self._seconds):
            raise RuntimeError(f"only {len(self._seconds)} recorded step times")
        self._next += 1
        return self._seconds[self._next - 1]
