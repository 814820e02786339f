"""How the model is laid out over devices (`ParallelConfig`), and the head-count arithmetic of a
tensor-parallel split (`tp_head_counts`: EngineConfig checks it, llmjax/parallel/heads.py lays
the weights out by it)."""

from __future__ import annotations

import dataclasses
import typing

from llmjax.config.checks import _check_positive


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is laid out over devices (llmjax/parallel/; ALGORITHMS.md §3 for PP).

    `tp`: tensor parallelism (Megatron): attention heads and the MLP hidden dimension split over
    `tp` devices, one all-reduce after attention and one after the MLP; KV pages split by KV head;
    embedding and LM head split over the vocabulary. tp must divide the model's heads, except that
    kv heads fewer than tp are repeated (each device keeps a copy of the kv head its query heads
    use, vLLM's replication), and `pad_heads=True` pads the kv heads (each with its group of query
    heads) to a multiple of tp with zero weights: exact outputs for more KV memory (SmolLM2's 3
    kv heads at tp=2 or 4: 4 heads, 33 % more).
    `pp`: pipeline stages (on disjoint device groups), each holding only its layers' weights and KV
    pages. `dp`: data-parallel replicas; must be 1 (run one engine per replica).
    `ep`: expert parallelism for a mixture of experts, within the tp devices (ep divides tp):
    the experts split into ep groups of E / ep whole experts, each group on tp / ep devices that
    split its experts' hidden dims (ep = tp: each device holds E / tp whole experts; ep = 1: every
    device holds a 1/tp slice of every expert). Attention and the rest stay tensor-parallel over
    all tp devices. Each device routes its share of the step's tokens, sends each (token, expert)
    pair to the devices of its expert's group and gets the result back (all-to-all,
    llmjax/model/moe.py), so a device computes only its own experts.
    `check_lockstep` (multi-host debugging): after every step each process compares a digest of
    the sampled tokens with the others' and raises on a difference.
    The mesh uses the first tp * pp devices of `jax.devices()` (all processes' devices after
    `jax.distributed.initialize`).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    pad_heads: bool = False
    check_lockstep: bool = False

    def __post_init__(self):
        _check_positive(self, "tp", "pp", "dp", "ep")
        if self.tp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide tp={self.tp}: expert parallelism splits the experts "
                "within the tensor-parallel devices (e.g. tp=8, ep=8 or ep=4)"
            )
        if self.dp != 1:
            raise ValueError(
                f"{self.dp=}: data-parallel replicas are not supported inside one engine; run "
                "one engine per replica"
            )

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp


class HeadCounts(typing.NamedTuple):
    """How tp devices split a model's attention heads (llmjax/parallel/heads.py's `HeadLayout`
    has these fields): `kind` 'as_is', 'replicate' or 'pad'; K' kv heads (a multiple of tp) and
    N' = K' * Q' query heads in all; `kv_repeats` (replicate: r); `num_pad_kv_heads` (pad:
    K' - K)."""

    kind: str
    num_kv_heads: int
    num_heads: int
    kv_repeats: int = 1
    num_pad_kv_heads: int = 0


def tp_head_counts(
    num_heads: int, num_kv_heads: int, tp: int, pad_heads: bool = False
) -> HeadCounts:
    """The head counts of splitting `num_heads` query heads over `num_kv_heads` kv heads across
    `tp` devices (the layouts: llmjax/parallel/heads.py). Without `pad_heads` an uneven split
    raises a ValueError that names the numbers."""
    K, N = num_kv_heads, num_heads
    Q = N // K
    if K % tp == 0:
        return HeadCounts("as_is", K, N)
    if tp % K == 0 and Q % (tp // K) == 0:
        return HeadCounts("replicate", tp, N, kv_repeats=tp // K)
    padded = -(-K // tp) * tp
    if pad_heads:
        return HeadCounts("pad", padded, padded * Q, num_pad_kv_heads=padded - K)
    raise ValueError(
        f"tp={tp} cannot split num_heads={N} / num_kv_heads={K} evenly (tp must divide the kv "
        f"heads, or be a multiple r of them with r dividing the {Q} query heads per kv head); "
        f"ParallelConfig(pad_heads=True) pads the kv heads {K} -> {padded} with zero weights "
        f"(exact outputs, {padded / K - 1:.0%} more KV memory)"
    )
