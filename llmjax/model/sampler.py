"""Sampling on the device: greedy, temperature, top-k, top-p, with per-request seeds; and, for
batches that ask for them, logits processing and log probabilities (`sample_processed`).

Each request's random key is `fold_in(key(seed), num_generated)`, so a request with a given seed
draws the same tokens whatever it is batched with. Every processing step works on its own row.
Letters: S sequences, V vocabulary, B logit-bias slots, L history tokens, K top logprobs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S] float32; 0 means greedy
    top_k: jax.Array,  # [S] int32; 0 means no top-k
    top_p: jax.Array,  # [S] float32; 1 means no top-p
    seeds: jax.Array,  # [S] uint32
    counters: jax.Array,  # [S] int32, tokens the request generated so far
    all_greedy: jax.Array | bool,  # [] bool: no row samples, so skip the sort
) -> jax.Array:
    """Next token id per row -> [S] int32."""
    greedy = greedy_ids(logits)
    random = lambda: _sample(logits, temperature, top_k, top_p, seeds, counters, greedy)
    return jax.lax.cond(all_greedy, lambda: greedy, random)


def greedy_ids(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, -1)` as int32 (the first maximum; the first NaN if a row has one), as
    a max and then a min over the positions holding it: two plain reductions, where XLA:CPU runs
    argmax's variadic (value, index) reduction ~1.7x slower (1.24 -> 0.74 ms at [16, 49152])."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN if the row has one
    hit = (logits == top) | jnp.isnan(logits)
    V = logits.shape[-1]
    positions = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, positions, V), axis=-1)


def sample_random(logits, temperature, top_k, top_p, seeds, counters) -> jax.Array:
    """`sample` (the same arguments but `all_greedy`) for a batch known to have a sampling
    row: the same tokens, without the all-greedy shortcut (the engine calls it as its own
    program after the step's forward)."""
    greedy = greedy_ids(logits)
    return _sample(logits, temperature, top_k, top_p, seeds, counters, greedy)


def _sample(logits, temperature, top_k, top_p, seeds, counters, greedy, min_p=None):
    masked = _filtered(logits, temperature, top_k, top_p, min_p)
    sampled = _draw(_keys(seeds, counters), masked)
    return jnp.where(temperature > 0, sampled, greedy)


def _filtered(logits, temperature, top_k, top_p, min_p=None):
    """The rows' logits over their temperature, the tokens min_p, top-k and top-p drop at -inf
    ([S, V], token-id order; greedy rows are only scaled by 1)."""
    is_random = temperature > 0
    scaled = logits / jnp.where(is_random, temperature, 1.0)[:, None]
    # Greedy rows' top-k / top-p are moot: dropped, so that they never make the batch rank.
    top_k, top_p = jnp.where(is_random, top_k, 0), jnp.where(is_random, top_p, 1.0)
    return jnp.where(_keep(scaled, top_k, top_p, min_p), scaled, -jnp.inf)


def _keys(seeds, counters):
    """Each row's key: `fold_in(key(seed), counter)` (counter = the output index it samples)."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def _draw(keys, masked):
    """One token per row from softmax(`masked`) ([S, V]; -inf: dropped) -> [S] int32, by the
    inverse of its CDF in token-id order at one uniform number per row (from the row's key): a
    softmax, a cumulative sum and a count, ~1.6 ms at [16, 49152] on 2 CPU cores, where a Gumbel
    draw over the sorted row (`jax.random.categorical` after an argsort) took ~80 ms. Each token
    gets its probability to within a float32 rounding of the running sum; a token of probability
    0 is never drawn (should the uniform round up to the total, the row's most likely token)."""
    probs = jax.nn.softmax(masked, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    u = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]
    idx = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), masked.shape[-1] - 1)
    ok = jnp.take_along_axis(probs, idx[:, None], axis=-1)[:, 0] > 0
    return jnp.where(ok, idx, greedy_ids(masked)).astype(jnp.int32)


# Rows with top-k or top-p whose kept tokens all rank in the first TRUNCATE_CAP find them with
# `lax.top_k` (3.9 ms at [16, 49152] on 2 CPU cores); rows that keep more (a top_k above the cap,
# or a top_p the first TRUNCATE_CAP tokens do not reach: flat distributions) find the boundary
# value by bisection over the float order instead of sorting (32 masked sums, ~8 ms, where the
# full argsort took ~70 ms). Which way a row goes depends on its own logits and parameters only,
# so its tokens do not depend on its batch.
TRUNCATE_CAP = 256


def _order_keys(x):
    """float32 -> uint32 keys in the same order (-inf lowest, +inf highest)."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _threshold(keys, weights, target):
    """Per row, the largest key t with sum(weights where keys >= t) >= target ([S, V] keys and
    weights, [S] target; by bisection over the 2^32 keys: 32 masked sums)."""
    lo = jnp.zeros(keys.shape[:1], jnp.uint32)  # sums over every key: the row's total
    hi = jnp.max(keys, axis=-1)

    def halve(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + (gap & 1)  # rounded up, without overflowing
        ok = jnp.sum(jnp.where(keys >= mid[:, None], weights, 0), axis=-1) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _prefix_by_threshold(keys, weights, target):
    """The tokens of the smallest prefix (descending, ties by token id) whose weight reaches
    `target`, the token that crosses it included: every key above the crossing key `t`, and
    the tokens at `t` whose weight before them (above t, then earlier ids at t) is below it."""
    t = _threshold(keys, weights, target)[:, None]
    above = keys > t
    before = jnp.sum(jnp.where(above, weights, 0), axis=-1, keepdims=True)
    at = keys == t
    ties = jnp.cumsum(jnp.where(at, weights, 0), axis=-1) - weights
    return above | (at & (before + ties < target[:, None]))


def _keep(scaled, top_k, top_p, min_p=None):
    """The tokens sampling keeps -> [S, V] bool, in token-id order, as vLLM filters: min_p (a
    token below min_p x the top probability drops), then top-k (the k most likely; 0: all), then
    top-p over what is left renormalized (the smallest prefix by probability whose mass reaches
    top_p: the token that crosses it stays; ties rank by token id)."""
    S, V = scaled.shape
    rows = jnp.arange(S)[:, None]
    keep = jnp.ones((S, V), bool)
    if min_p is not None:  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
        keep = scaled >= jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    x = jnp.where(keep, scaled, -jnp.inf)
    truncates = (top_k > 0) | (top_p < 1)

    def by_rank():
        cap = min(V, TRUNCATE_CAP)
        values, ids = jax.lax.top_k(x, cap)
        ranks = jnp.arange(cap, dtype=jnp.int32)[None, :]
        outside_k = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
        v = jnp.where(outside_k, -jnp.inf, values)
        k_bound = (top_k > 0) & (top_k <= cap)
        # The normalizer: over the row's top k if that is within the cap, else over all of it.
        lse = jnp.where(k_bound, jax.nn.logsumexp(v, axis=-1), jax.nn.logsumexp(x, axis=-1))
        probs = jnp.exp(v - lse[:, None])
        mass = jnp.cumsum(probs, axis=-1)
        # (top_p >= 1 keeps all: the float32 running mass can reach 1 before the last token.)
        inside_p = (mass - probs < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1)
        covered = k_bound | ((top_k <= 0) & (mass[:, -1] >= top_p)) | (cap == V)
        from_cap = jnp.zeros((S, V), bool).at[rows, ids].set(~outside_k & inside_p)

        def by_threshold():
            keys = _order_keys(x)
            k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).astype(jnp.float32)
            in_k = jax.lax.cond(  # rows without top-k keep all either way
                jnp.any(top_k > cap),
                lambda: _prefix_by_threshold(keys, jnp.ones((S, V), jnp.float32), k),
                lambda: jnp.ones((S, V), bool),
            )
            p = jax.nn.softmax(jnp.where(in_k, x, -jnp.inf), axis=-1)
            in_p = _prefix_by_threshold(keys, p, top_p) | (top_p[:, None] >= 1)
            return in_k & in_p

        needs_more = jnp.any(truncates & ~covered)
        past_cap = jax.lax.cond(needs_more, by_threshold, lambda: jnp.ones((S, V), bool))
        ranked = jnp.where(covered[:, None], from_cap, past_cap)
        return keep & jnp.where(truncates[:, None], ranked, True)

    # Rows without top-k or top-p keep `keep` either way: skip the ranking when none has them.
    return jax.lax.cond(jnp.any(truncates), by_rank, lambda: keep)


ACCEPT_SALT = 0x5EC0  # folded into a row's key for its acceptance test (not its sample)


def verify_proposals(
    logits: jax.Array,  # [R, V]: the step's logits rows (StepInput.logits_indices)
    greedy: jax.Array | None,  # [R] int32: their argmax (the step's own), or None
    first_rows: jax.Array,  # [S] int32: each sequence's first row in `logits`
    row_seq: jax.Array,  # [R] int32: the sequence of each row
    row_pos: jax.Array,  # [R] int32: its index j within the sequence's rows (> K: padding)
    proposals: jax.Array,  # [S, K] int32: proposed tokens; -1 pads
    num_proposals: jax.Array,  # [S] int32: k_i <= K (0: a plain row)
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,  # [S] int32: tokens each request generated before this step
    all_greedy: jax.Array | bool,
):
    """Speculative decoding's verification -> (tokens [S, K + 1] int32, num_accepted [S]
    int32): sequence i gains tokens[i, :num_accepted[i] + 1] (its accepted proposals, then the
    target's own token: the correction at the first rejection, or the bonus after k_i).

    Row j of sequence i (its logits at `first_rows[i] + j`) follows the tokens before it and
    the first j proposals. Greedy rows (temperature 0) accept proposal j while it equals the
    row's argmax, so their tokens are exactly what decoding one token a step would give. Sampled
    rows use rejection sampling for a point-mass proposal (a proposer that outputs x with
    probability 1, as prompt lookup and greedy drafts do): accept x with probability p(x), where
    p is the row's distribution after temperature, top-k and top-p; on rejection sample p with x
    removed, renormalized. Either way the token at that position has distribution p (Leviathan
    et al., 2023, with q = one-hot(x)). Row j's randomness is keyed by output index counter + j,
    the same key plain sampling uses, so a row without proposals (k_i = 0) samples the very
    token `sample` would. The work is per logits row (R of them, no more); an all-greedy step
    only compares the step's argmax with the proposals."""
    K = proposals.shape[1]
    R = logits.shape[0]
    if greedy is None:
        greedy = greedy_ids(logits)
    has_draft = row_pos < num_proposals[row_seq]
    draft_r = jnp.where(has_draft, proposals[row_seq, jnp.minimum(row_pos, K - 1)], -1)

    def greedy_only():
        return greedy, draft_r == greedy

    def with_sampling():
        temp = temperature[row_seq]
        masked = _filtered(logits, temp, top_k[row_seq], top_p[row_seq])
        probs = jax.nn.softmax(masked, axis=-1)
        is_draft = jnp.arange(logits.shape[-1])[None, :] == draft_r[:, None]
        p_draft = jnp.sum(jnp.where(is_draft, probs, 0.0), axis=-1)
        residual = jnp.where(is_draft, -jnp.inf, masked)
        keys = _keys(seeds[row_seq], counters[row_seq] + row_pos)
        sampled = _draw(keys, residual)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT)))(keys)
        nothing_left = ~jnp.any(jnp.isfinite(residual), axis=-1)  # p(x) = 1
        accept = (u < p_draft) | nothing_left
        is_random = temp > 0
        return (
            jnp.where(is_random, sampled, greedy),
            jnp.where(is_random, accept, draft_r == greedy),
        )

    token_r, accept_r = jax.lax.cond(all_greedy, greedy_only, with_sampling)
    j = jnp.arange(K + 1, dtype=jnp.int32)
    rows = jnp.minimum(first_rows[:, None] + j[None, :], R - 1)  # [S, K + 1]
    is_proposal = j[None, :] < num_proposals[:, None]
    accept = accept_r[rows] & is_proposal
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    tokens = jnp.where(accept, draft_r[rows], token_r[rows])
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32)


def process_logits(
    logits: jax.Array,  # [S, V]
    bias_ids: jax.Array,  # [S, B] int32; -1 pads
    bias_values: jax.Array,  # [S, B] float32 (min_tokens' -inf entries among them)
    history_ids: jax.Array,  # [S, L] int32: the prompt's then the output's tokens; -1 pads
    history_is_output: jax.Array,  # [S, L] bool
    presence: jax.Array,  # [S] float32
    frequency: jax.Array,  # [S] float32
    repetition: jax.Array,  # [S] float32
) -> jax.Array:
    """vLLM's logits processing before sampling -> [S, V] float32: logit_bias (and min_tokens'
    masks) added, then the repetition penalty on every token of the prompt or the output
    (divides a positive logit, multiplies the others), the frequency penalty times each token's
    count in the output, the presence penalty once per token in the output."""
    S, V = logits.shape
    x = logits.astype(jnp.float32)
    rows = jnp.arange(S)[:, None]
    used = bias_ids >= 0
    x = x.at[rows, jnp.where(used, bias_ids, 0)].add(jnp.where(used, bias_values, 0.0))
    valid = history_ids >= 0
    ids = jnp.where(valid, history_ids, 0)
    counts = (
        jnp.zeros((S, V), jnp.float32)
        .at[rows, ids]
        .add((valid & history_is_output).astype(jnp.float32))
    )
    in_prompt = (
        jnp.zeros((S, V), jnp.float32)
        .at[rows, ids]
        .max((valid & ~history_is_output).astype(jnp.float32))
    )
    seen = (in_prompt > 0) | (counts > 0)
    rep = jnp.where(seen, repetition[:, None], 1.0)
    x = jnp.where(x > 0, x / rep, x * rep)
    x = x - frequency[:, None] * counts
    return x - presence[:, None] * (counts > 0)


def sample_processed(
    logits,
    temperature,
    top_k,
    top_p,
    seeds,
    counters,
    min_p,  # [S] float32
    bias_ids,
    bias_values,
    history_ids,
    history_is_output,
    presence,
    frequency,
    repetition,
    bitmask=None,  # [S, W] int32: bit t % 32 of word t // 32 set if token t is allowed
    *,
    num_logprobs: int,
):
    """The structured-outputs `bitmask` (if any) applied first, then `process_logits`, then
    greedy (argmax) or temperature, min_p, top-k, top-p sampling as `sample` does -> (ids [S]
    int32, logprobs); logprobs, when `num_logprobs` > 0 (static): (top ids [S, K], their log
    probabilities [S, K], the sampled token's [S], its rank [S], 1 = the most likely), from the
    log-softmax of the logits as the model gave them (masked by the bitmask); else None."""
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    x = process_logits(
        logits, bias_ids, bias_values, history_ids, history_is_output, presence, frequency,
        repetition,
    )  # fmt: skip
    greedy = greedy_ids(x)
    random = lambda: _sample(x, temperature, top_k, top_p, seeds, counters, greedy, min_p)
    ids = jax.lax.cond(jnp.all(temperature <= 0), lambda: greedy, random)  # no sort if greedy
    if not num_logprobs:
        return ids, None
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_values, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
    return ids, (top_ids.astype(jnp.int32), top_values, chosen, rank)


def prompt_logprobs(
    logits: jax.Array,  # [T, V]: every token row's logits
    last_rows: jax.Array,  # [S] int32: each sequence's sampling row
    targets: jax.Array,  # [T] int32: the prompt token each row predicts, -1 for none
    *,
    num_logprobs: int,
):
    """For a step that computes prompt logprobs -> (logits [S, V] of the sampling rows, their
    greedy ids [S], (the targets' log probabilities [T], their ranks [T], the top ids [T, K] and
    log probabilities [T, K])), from the raw log-softmax of each row."""
    rows = logits[last_rows]
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_values, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    target = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > target[:, None], axis=-1).astype(jnp.int32)
    return rows, greedy_ids(rows), (target, rank, top_ids.astype(jnp.int32), top_values)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear -> -inf ([S, V] logits, [S, ceil(V / 32)] int32 words, bit
    t % 32 of word t // 32 for token t: llguidance's layout)."""
    S, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
