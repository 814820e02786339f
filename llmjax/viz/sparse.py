"""InfiniGen's skewing and speculation, and accuracy against bytes fetched
(colab/06_sparse_kv.ipynb; llmjax/sparse/, ALGORITHMS.md §11).

Data helpers (numpy unless marked jax):

  group_queries      one kv head's post-RoPE queries, its group's query heads stacked ([Q * n,
                     H]), as `skewing_matrices` stacks them for the SVD
  singular_values    a matrix's singular values, largest first, divided by the largest
  column_energy      each column's share of a matrix's energy (sum of squares); the skew only
                     rotates, so the total is unchanged and the shares are comparable
  cumulative_energy  the share held by the k most energetic columns, k = 1 .. H
  unskewed           the identity "skew" with the raw columns' energies: InfiniGen without
                     skewing, for comparison
  kept_energy        per layer and kv head, the share of Q's and K's energy in the columns the
                     speculation keeps (`partial_columns`), skewed, against the best as many
                     unskewed columns
  trace_prefill      (jax) one prefill recording every layer's attention input and post-RoPE
                     queries and keys: what layer i sees while it speculates layer i + 1
  speculation        (jax) for one token and one speculated layer: the true attention of that
                     layer, InfiniGen's speculated logits (the layer's query predicted from the
                     previous layer's attention input, skewed and cut to the kept columns,
                     against the partial keys), and what `infinigen.speculate` selects
  attention_recall   the share of each query head's true attention that falls on the selected
                     tokens
  speculation_quality  correlation of speculated and true logits, and recall, on the tokens
                     the speculation decides (not the sinks and recent tokens fetched anyway)
  split_run          the halves of a batched `teacher_forced` run (text | continuations)
  accuracy_row       one setting's perplexity, greedy agreement and fetched fraction from
                     `llmjax.sparse.evaluate.teacher_forced` runs, as scripts/eval_sparse.py
                     reports them

Plots: `plot_singular_values`, `plot_skew_energy` (cumulative column energy before and after
skewing), `plot_column_magnitudes` (|Q| and |QA| as images), `plot_kept_energy` (over layers),
`plot_attention_maps` (true vs speculated attention vs selection over the context),
`plot_speculation_scatter`, `plot_by_layer`, `plot_accuracy_vs_bytes` and
`plot_fetch_bytes` (host -> device KV bytes per decode token from `EngineStats`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import numpy as np

from llmjax.viz import new_axes, pyplot

Q_COLOR, K_COLOR = "tab:blue", "tab:orange"
GRANULARITY_COLORS = {"token": "tab:blue", "page": "tab:green"}
MODE_COLORS = {"oracle": "0.3", "infinigen": "tab:blue", "quest": "tab:green", "h2o": "tab:orange"}
VARIANT_COLORS = ("tab:purple", "tab:cyan", "tab:brown", "tab:pink", "tab:olive")
SELECTED_COLOR, OTHER_COLOR = "tab:red", "0.6"


# ------------------------------------------------------------------------------------------------
# Skewing.


def group_queries(q: np.ndarray, kv_head: int, num_kv_heads: int) -> np.ndarray:
    """q [n, N, H] (one layer's post-RoPE queries) -> [Q * n, H], the queries of kv head
    `kv_head`'s Q = N / K query heads stacked head by head (`skewing_matrices`' layout)."""
    n, N, H = q.shape
    Q = N // num_kv_heads
    group = np.asarray(q[:, kv_head * Q : (kv_head + 1) * Q], np.float64)
    return group.transpose(1, 0, 2).reshape(Q * n, H)


def singular_values(x: np.ndarray) -> np.ndarray:
    """x [n, H] -> its singular values, descending, divided by the largest. An orthogonal skew
    (x @ A) leaves them unchanged."""
    s = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    return s / s[0] if s[0] > 0 else s


def column_energy(x: np.ndarray) -> np.ndarray:
    """x [n, H] -> [H]: each column's sum of squares over the total (sums to 1)."""
    e = (np.asarray(x, np.float64) ** 2).sum(axis=0)
    return e / e.sum()


def cumulative_energy(x: np.ndarray) -> np.ndarray:
    """x [n, H] -> [H]: entry k-1 is the share of x's energy in its k most energetic columns."""
    return np.cumsum(np.sort(column_energy(x))[::-1])


def kept_energy(queries, keys, skew, energy, partial_weight_ratio: float, num_kv_heads: int):
    """Per layer and kv head, the share of the queries' and keys' energy in the columns that
    the speculation keeps: skewed (`partial_columns` of `energy`, as the engine keeps them)
    against the unskewed (the same number of columns, the queries' most energetic).

    queries / keys: per layer [n, N, H] / [n, K, H] (`collect_qk`); skew [L, K, H, H],
    energy [L, K, H] (`skewing_matrices`). Returns a dict of [L, K] arrays: 'q_before',
    'q_after', 'k_before', 'k_after'."""
    from llmjax.sparse.skew import partial_columns

    kept = partial_columns(np.asarray(energy), partial_weight_ratio)  # [L, K, c]
    L, K, c = kept.shape
    out = {name: np.zeros((L, K)) for name in ("q_before", "q_after", "k_before", "k_after")}
    for layer in range(L):
        for g in range(K):
            q = group_queries(queries[layer], g, num_kv_heads)
            k = np.asarray(keys[layer][:, g], np.float64)
            raw = np.argsort(-np.abs(q).sum(axis=0), kind="stable")[:c]
            A = np.asarray(skew[layer, g], np.float64)
            cols = kept[layer, g]
            out["q_before"][layer, g] = column_energy(q)[raw].sum()
            out["k_before"][layer, g] = column_energy(k)[raw].sum()
            out["q_after"][layer, g] = column_energy(q @ A)[cols].sum()
            out["k_after"][layer, g] = column_energy(k @ A)[cols].sum()
    return out


def unskewed(queries, num_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """The no-skew ablation in `skewing_matrices`' format: (identity [L, K, H, H], each raw
    column's energy sum_t |Q| over the group's queries [L, K, H]), so that the speculation keeps
    the queries' most energetic *unrotated* columns."""
    L = len(queries)
    H = queries[0].shape[-1]
    skew = np.broadcast_to(np.eye(H, dtype=np.float32), (L, num_kv_heads, H, H)).copy()
    energy = np.array(
        [
            [np.abs(group_queries(q, g, num_kv_heads)).sum(axis=0) for g in range(num_kv_heads)]
            for q in queries
        ],
        np.float32,
    )
    return skew, energy


def plot_singular_values(q: np.ndarray, k: np.ndarray, ax=None):
    """Normalized singular values of one head's queries `q` [m, H] and keys `k` [n, H]
    (log scale): how few directions hold most of each. Returns the Axes."""
    ax = new_axes(ax)
    for x, name, color in ((q, "queries Q", Q_COLOR), (k, "keys K", K_COLOR)):
        s = singular_values(x)
        ax.semilogy(np.arange(1, len(s) + 1), s, "o-", markersize=3, color=color, label=name)
    ax.set_xlabel("singular value index")
    ax.set_ylabel("singular value / largest")
    ax.set_title("singular values (unchanged by the skew)")
    ax.legend(frameon=False)
    return ax


def plot_skew_energy(
    q: np.ndarray, k: np.ndarray, skew: np.ndarray, partial_weight_ratio: float = 0.2, ax=None
):
    """Cumulative share of energy in the k most energetic columns, k = 1 .. H, for one head's
    queries `q` [m, H] and keys `k` [n, H] before (dashed) and after (solid) skewing by
    `skew` [H, H]; the dotted vertical line marks the columns the partial key cache keeps
    (`partial_weight_ratio` of H). Returns the Axes."""
    ax = new_axes(ax)
    H = q.shape[1]
    x = np.arange(1, H + 1)
    for data, name, color in ((q, "Q", Q_COLOR), (k, "K", K_COLOR)):
        ax.plot(x, cumulative_energy(data), "--", color=color, label=f"{name} before")
        ax.plot(x, cumulative_energy(data @ skew), "-", color=color, label=f"{name} skewed")
    c = max(1, round(partial_weight_ratio * H))
    ax.axvline(c, color="black", linestyle=":", linewidth=1.0, label=f"{c} kept columns")
    ax.set_xlabel("most energetic columns")
    ax.set_ylabel("share of energy")
    ax.set_ylim(0, 1.02)
    ax.set_title("energy concentration by the skew")
    ax.legend(frameon=False, fontsize=8, loc="lower right")
    return ax


def plot_column_magnitudes(q: np.ndarray, skew: np.ndarray, num_tokens: int = 128):
    """|Q| and |Q A| for the first `num_tokens` rows of `q` [m, H], as two images (tokens x
    columns, columns sorted by energy, most energetic left): after the skew a few bright columns
    carry the query. Returns the Figure."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
    for ax, data, title in ((axes[0], q, "|Q| (before)"), (axes[1], q @ skew, "|Q A| (skewed)")):
        order = np.argsort(-column_energy(data), kind="stable")
        image = np.abs(data[:num_tokens][:, order])
        ax.imshow(image, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("column (by energy)")
    axes[0].set_ylabel("query row")
    fig.tight_layout()
    return fig


def plot_kept_energy(kept: Mapping[str, np.ndarray], ax=None):
    """`kept_energy` over layers (mean over kv heads): the share of Q's (blue) and K's (orange)
    energy in the kept columns, skewed (solid) and unskewed (dashed). Returns the Axes."""
    ax = new_axes(ax)
    layers = np.arange(kept["q_after"].shape[0])
    for key, label, color, style in (
        ("q_after", "Q skewed", Q_COLOR, "-"),
        ("q_before", "Q before", Q_COLOR, "--"),
        ("k_after", "K skewed", K_COLOR, "-"),
        ("k_before", "K before", K_COLOR, "--"),
    ):
        ax.plot(layers, kept[key].mean(axis=1), style, marker=".", color=color, label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of energy in the kept columns")
    ax.set_ylim(0, 1.02)
    ax.legend(frameon=False, fontsize=8)
    return ax


# ------------------------------------------------------------------------------------------------
# Speculation.


@dataclasses.dataclass
class PrefillTrace:
    """Per layer, from one prefill of n tokens: the attention input (after the layer's RMSNorm)
    [n, D] and the post-RoPE queries [n, N, H] and keys [n, K, H]; numpy float32."""

    attn_inputs: list[np.ndarray]
    queries: list[np.ndarray]
    keys: list[np.ndarray]


def trace_prefill(params, config, token_ids, page_size: int = 16) -> PrefillTrace:
    """(jax) Prefill `token_ids` (jitted, the jnp reference attention) layer by layer with
    `llmjax.model.llama.decoder_layer`, recording what each layer's attention sees."""
    import jax

    from llmjax.model.attention import reference_attention
    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.layers import norm, rope_cos_sin
    from llmjax.model.llama import decoder_layer, embed_tokens
    from llmjax.model.params import unstack_layers
    from llmjax.model.step_input import contiguous_prefill

    params = unstack_layers(params)
    n = len(token_ids)
    step, _ = contiguous_prefill([list(token_ids)], n, page_size)

    def run(params, kv, step):
        x = embed_tokens(params, step.token_ids, config)
        cos, sin = rope_cos_sin(step.positions, config)
        kinds = config.layer_kind_ids
        inputs, queries, keys = [], [], []

        def recording(q, k_pages, v_pages, step, *, new_kv=None, **kw):
            queries.append(q.astype(np.float32))
            keys.append(new_kv[0].astype(np.float32))
            return reference_attention(q, k_pages, v_pages, step, **kw)

        for i, (layer, layer_kv) in enumerate(zip(params["layers"], kv, strict=True)):
            inputs.append(norm(x, layer["attn_norm"], config).astype(np.float32))
            x, _ = decoder_layer(layer, x, layer_kv, step, cos, sin, config, recording, kinds[i])
        return inputs, queries, keys

    dtype = params["final_norm"].dtype  # the activations' (weights may be packed)
    kv = allocate_kv_pages(config, -(-n // page_size) + 1, page_size, dtype)
    out = jax.jit(run)(params, kv, step)
    return PrefillTrace(*([np.asarray(a) for a in part] for part in out))


@dataclasses.dataclass
class Speculation:
    """One token at `position`, speculated layer `layer` (C = position + 1 keys).

    true_logits [N, C]: the layer's real q . k * scale; true_probs [N, C] their softmax.
    predicted_logits [K, C]: InfiniGen's speculated logits (partial skewed query from the
    previous layer's attention input against the partial keys, best query head of each group).
    selected [K, C]: the rows the layer attends to under `sparse` (sinks, recent tokens, the
    speculated ones, and the token itself)."""

    layer: int
    position: int
    true_logits: np.ndarray
    true_probs: np.ndarray
    predicted_logits: np.ndarray
    selected: np.ndarray

    @property
    def group_size(self) -> int:
        return self.true_logits.shape[0] // self.selected.shape[0]


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


def speculation(
    trace: PrefillTrace,
    params,
    config,
    skew,
    energy,
    sparse,
    layer: int,
    position: int,
    page_size: int = 16,
) -> Speculation:
    """(jax) InfiniGen's speculation of layer `layer` (>= 1) for the token at `position` of a
    traced prefill, as a decode step would run it while layer - 1 computes: the next layer's
    query from layer - 1's attention input (`h @ W_q` of `layer`, RoPE at `position`), skewed
    and cut to the kept columns (`speculation_weights`), scored against the keys 0..position
    skewed and cut the same way (the partial key cache), and the rows `infinigen.speculate`
    selects under `sparse` (a SparseKVConfig: alpha, max_num_kv, sinks, recent, granularity).
    Also the layer's true attention for comparison."""
    import jax.numpy as jnp

    from llmjax.model.layers import apply_rope, layer_rope, rope_cos_sin
    from llmjax.model.params import layer_params
    from llmjax.model.step_input import StepInput
    from llmjax.sparse import infinigen

    if not 1 <= layer < config.num_layers:
        raise ValueError(f"{layer=} must be in [1, {config.num_layers}): layer 0 has no previous")
    if not 0 <= position < trace.keys[layer].shape[0]:
        raise ValueError(f"{position=} is outside the traced {trace.keys[layer].shape[0]} tokens")
    K, H = config.num_kv_heads, config.head_dim
    N = config.num_heads
    Q, C, G = N // K, position + 1, page_size
    scale = H**-0.5
    # The kept columns of every layer but 0 (`sparse` may call `layer` dense; show it anyway).
    every = dataclasses.replace(sparse, mode="infinigen", num_dense_layers=1)
    a_part = infinigen.speculation_weights(np.asarray(skew), np.asarray(energy), config, every)[
        layer
    ]
    a_part = np.asarray(a_part)  # [K, H, c]
    weights = layer_params(params, layer)
    wq = np.asarray(weights["wq"], np.float32)  # [D, N, H]
    h = trace.attn_inputs[layer - 1][position]  # [D]
    q_next = (h @ wq.reshape(wq.shape[0], -1)).reshape(1, N, H)
    if config.attention_bias:
        q_next = q_next + np.asarray(weights["bq"], np.float32)
    rope = rope_cos_sin(jnp.array([position], jnp.int32), config)
    cos, sin = layer_rope(*rope, config.layer_kind_ids[layer])
    q_next = np.asarray(apply_rope(jnp.asarray(q_next), cos, sin))  # [1, N, H]
    keys = trace.keys[layer][:C]  # [C, K, H]
    k_part = np.einsum("jkh,khc->jkc", keys, a_part)  # the partial key cache's rows
    q_part = np.einsum("kqh,khc->kqc", q_next[0].reshape(K, Q, H), a_part)
    predicted = (np.einsum("kqc,jkc->kqj", q_part, k_part) * scale).max(axis=1)  # [K, C]
    q_true = trace.queries[layer][position].reshape(K, Q, H)
    true_logits = np.einsum("kqh,jkh->kqj", q_true, keys).reshape(N, C) * scale
    # The selection itself, by the engine's code: one decode step over pages 1..P.
    P = -(-C // G)
    c = a_part.shape[-1]
    partial_pages = np.zeros(((1 + P) * G, K, c), np.float32)
    partial_pages[G : G + C] = k_part
    step = StepInput(
        token_ids=np.zeros(1, np.int32),  # (unused by the speculation)
        positions=np.array([position], np.int32),
        slot_mapping=np.array([G + position], np.int32),
        cu_q_lens=np.array([0, 1], np.int32),
        kv_lens=np.array([C], np.int32),
        page_indices=(1 + np.arange(P, dtype=np.int32))[None],
        num_seqs=np.array([1], np.int32),
        logits_indices=np.zeros(1, np.int32),
    )
    pos, valid = _jitted_speculate()(
        q_next,
        partial_pages.reshape(1 + P, G, K, c),
        a_part,
        step,
        np.zeros(1, np.int32),
        sparse=sparse,
        sm_scale=scale,
        window=config.sliding_window,
    )
    pos, valid = np.asarray(pos)[0], np.asarray(valid)[0]  # [K, M]
    selected = np.zeros((K, C), bool)
    for g in range(K):
        selected[g, pos[g][valid[g]]] = True
    selected[:, position] = True  # the token's own row comes from the step
    return Speculation(
        layer=layer,
        position=position,
        true_logits=true_logits,
        true_probs=_softmax(true_logits),
        predicted_logits=predicted,
        selected=selected,
    )


@functools.cache
def _jitted_speculate():
    import jax

    from llmjax.sparse import infinigen

    return jax.jit(infinigen.speculate, static_argnames=("sparse", "sm_scale", "window"))


def attention_recall(true_probs: np.ndarray, selected: np.ndarray) -> np.ndarray:
    """true_probs [N, C] (each row sums to 1), selected [K, C] -> [N]: the share of each query
    head's attention on the rows its kv head fetched (query head n uses kv head n // (N / K))."""
    N, K = true_probs.shape[0], selected.shape[0]
    mask = np.repeat(selected, N // K, axis=0)
    return (true_probs * mask).sum(axis=1)


def speculation_quality(spec: Speculation, num_sink_tokens: int, num_recent_tokens: int) -> dict:
    """How good one speculation is, on the *candidate* tokens (neither the sinks nor the recent
    window, which are fetched whatever the speculation says; as `infinigen.speculate` defines
    them): 'correlation' [K], Pearson r between the speculated and the true logits (best query
    head of each group); 'candidate_recall' [N], the share of each query head's attention on
    candidates that falls on the selected ones; 'recall' [N], `attention_recall` (everything
    fetched, sinks and recent tokens included)."""
    C = spec.position + 1
    pos = np.arange(C)
    cand = (pos >= num_sink_tokens) & (pos < spec.position - (num_recent_tokens - 1))
    K = spec.selected.shape[0]
    true = _group_max(spec.true_logits, K)
    corr = np.array(
        [
            np.corrcoef(true[g, cand], spec.predicted_logits[g, cand])[0, 1]
            if cand.sum() > 1
            else np.nan
            for g in range(K)
        ]
    )
    probs = spec.true_probs[:, cand]
    chosen = np.repeat(spec.selected, spec.group_size, axis=0)[:, cand]
    mass = probs.sum(axis=1)
    cand_recall = np.where(mass > 0, (probs * chosen).sum(axis=1) / np.maximum(mass, 1e-30), 1.0)
    return {
        "correlation": corr,
        "candidate_recall": cand_recall,
        "recall": attention_recall(spec.true_probs, spec.selected),
    }


def _group_max(x: np.ndarray, K: int) -> np.ndarray:
    """[N, C] -> [K, C], the max over each kv head's query heads."""
    N, C = x.shape
    return x.reshape(K, N // K, C).max(axis=1)


def top_tokens(spec: Speculation, tokens: Sequence[str], n: int = 5) -> list[tuple[int, str]]:
    """The `n` positions the layer attends to most (max over heads), with their tokens."""
    top = np.argsort(-spec.true_probs.max(axis=0), kind="stable")[:n]
    return [(int(i), tokens[i]) for i in top]


def _vmax(image: np.ndarray) -> float:
    """The colour scale's top: the 99th percentile, so one dominant token (the sink) saturates
    instead of darkening everything else."""
    return max(float(np.quantile(image, 0.99)), 1e-12)


def plot_attention_maps(spec: Speculation, tokens: Sequence[str] | None = None):
    """Three images over the context (kv heads x key positions): the layer's true attention
    (max over each kv head's query heads), the speculated attention (softmax of the speculated
    logits), both with a square-root colour scale topped at the 99th percentile so that weak
    attention shows, and the rows selected. With `tokens` (decoded, one per position) the title
    lists the most attended ones. Returns the Figure."""
    plt = pyplot()
    from matplotlib.colors import PowerNorm

    K = spec.selected.shape[0]
    true = _group_max(spec.true_probs, K)
    predicted = _softmax(spec.predicted_logits)
    fig, axes = plt.subplots(3, 1, figsize=(12, 4.6), sharex=True)
    title = f"true attention of layer {spec.layer}"
    if tokens is not None:
        title += ": most on " + ", ".join(f"{t!r}@{i}" for i, t in top_tokens(spec, tokens))
    fetched = f"fetched: {', '.join(map(str, spec.selected.sum(axis=1)))} of {true.shape[1]} rows"
    panels = (
        (true, title, PowerNorm(0.5, 0, _vmax(true)), "viridis"),
        (
            predicted,
            "speculated one layer early (partial query x partial keys)",
            PowerNorm(0.5, 0, _vmax(predicted)),
            "viridis",
        ),
        (spec.selected.astype(float), fetched, None, "Reds"),
    )
    for ax, (image, label, norm, cmap) in zip(axes, panels, strict=True):
        ax.imshow(image, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_yticks(range(K), [f"kv {g}" for g in range(K)], fontsize=7)
    axes[-1].set_xlabel(f"key position (the decode token is {spec.position})")
    fig.tight_layout()
    return fig


def plot_speculation_scatter(spec: Speculation, kv_head: int = 0, ax=None):
    """One kv head: each cached token's speculated logit against its true logit (the best of the
    group's query heads), selected tokens in red; the title gives their correlation and the share
    of the true attention the selection covers. Returns the Axes."""
    ax = new_axes(ax, figsize=(5.0, 4.0))
    K = spec.selected.shape[0]
    true = _group_max(spec.true_logits, K)[kv_head]
    pred = spec.predicted_logits[kv_head]
    sel = spec.selected[kv_head]
    ax.scatter(true[~sel], pred[~sel], s=6, color=OTHER_COLOR, label="not fetched")
    ax.scatter(true[sel], pred[sel], s=8, color=SELECTED_COLOR, label="fetched")
    r = np.corrcoef(true, pred)[0, 1] if len(true) > 1 else float("nan")
    Q = spec.group_size
    recall = attention_recall(spec.true_probs, spec.selected)[kv_head * Q : (kv_head + 1) * Q]
    ax.set_xlabel("true logit q·k/√H (best query head)")
    ax.set_ylabel("speculated logit (partial, skewed)")
    ax.set_title(
        f"layer {spec.layer}, kv head {kv_head}: r = {r:.2f}, "
        f"{sel.sum()} of {len(sel)} fetched hold {recall.mean():.0%} of attention",
        fontsize=9,
    )
    ax.legend(frameon=False, fontsize=8)
    return ax


def plot_by_layer(
    layers: Sequence[int],
    series: Mapping[str, np.ndarray],
    ylabel: str,
    fetched: Sequence[float] | None = None,
    ax=None,
):
    """Per speculated layer, one line per named run in `series` ([L', X] each, e.g. a
    `speculation_quality` entry per layer): the mean over X (heads) with a min-max band; with
    `fetched` [L'], the fraction of cached rows fetched (dashed). Returns the Axes."""
    ax = new_axes(ax)
    colors = [Q_COLOR, "tab:purple", "tab:brown", "tab:olive"]
    for (name, values), color in zip(series.items(), colors, strict=False):
        values = np.asarray(values)
        ax.plot(layers, values.mean(axis=1), "o-", markersize=3, color=color, label=name)
        ax.fill_between(layers, values.min(axis=1), values.max(axis=1), color=color, alpha=0.15)
    if fetched is not None:
        ax.plot(layers, fetched, "s--", markersize=3, color=SELECTED_COLOR, label="rows fetched")
    ax.set_xlabel("speculated layer")
    ax.set_ylabel(ylabel)
    ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.02)
    ax.legend(frameon=False, fontsize=8, loc="lower right")
    return ax


# ------------------------------------------------------------------------------------------------
# Accuracy against bytes.


def split_run(run, n: int):
    """A `TeacherForced` of stacked sequences -> (its first n rows, the rest): one batched run
    scores the held-out text and the greedy continuations together (rows are independent)."""
    part = lambda sl: dataclasses.replace(
        run, nll=run.nll[sl], argmax=run.argmax[sl], rows=run.rows[sl]
    )
    return part(slice(0, n)), part(slice(n, None))


def accuracy_row(setting: str, sparse, ppl_run, gen_run, full_ppl, full_gen) -> dict:
    """One setting's numbers from `teacher_forced` runs on held-out text (`ppl_run`) and on full
    attention's greedy continuation (`gen_run`), against full attention's runs (`full_*`):
    perplexity, greedy agreement (the share of positions whose greedy token equals full
    attention's; the last position has no next given token and is left out) and the fraction of
    full attention's KV rows fetched over the decode steps (the prefill, full for everyone, left
    out): `llmjax.sparse.evaluate`'s measures, as scripts/eval_sparse.py reports them."""
    from llmjax.sparse.evaluate import fetched_fraction, greedy_agreement

    return {
        "setting": setting,
        "mode": sparse.mode,
        "selection": sparse.selection,
        "granularity": sparse.granularity,
        "alpha": sparse.alpha,
        "perplexity": ppl_run.perplexity,
        "greedy_agreement": greedy_agreement(gen_run, full_gen),
        "fetched_fraction": fetched_fraction(ppl_run, full_ppl),
    }


def plot_accuracy_vs_bytes(rows: Sequence[Mapping], metric: str = "perplexity", ax=None):
    """`metric` ('perplexity' or 'greedy_agreement') against the fraction of KV bytes fetched,
    from `accuracy_row`s: one line per granularity through its alphas (labelled), full attention
    ('offload' rows) as a black star at its fetched fraction (1.0). Returns the Axes."""
    ax = new_axes(ax)
    for row in rows:
        if row["mode"] != "infinigen":
            ax.plot(row["fetched_fraction"], row[metric], "k*", markersize=12, label="full")
    for granularity, color in GRANULARITY_COLORS.items():
        pts = sorted(
            (r for r in rows if r["mode"] == "infinigen" and r["granularity"] == granularity),
            key=lambda r: r["alpha"],
        )
        if not pts:
            continue
        x = [r["fetched_fraction"] for r in pts]
        y = [r[metric] for r in pts]
        ax.plot(x, y, "o-", color=color, label=f"{granularity}s")
        for i, r in enumerate(pts):  # alternate above and below: capped settings coincide
            ax.annotate(
                f"α={r['alpha']:g}",
                (r["fetched_fraction"], r[metric]),
                xytext=(4, 4 if i % 2 == 0 else -10),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )
    ax.set_xlabel("KV bytes fetched / full attention's")
    ax.set_ylabel({"greedy_agreement": "greedy agreement"}.get(metric, metric))
    ax.legend(frameon=False, fontsize=8)
    return ax


def plot_modes_vs_bytes(rows: Sequence[Mapping], metric: str = "perplexity", ax=None):
    """`metric` against the fraction of KV bytes fetched for each selection at several budgets
    (`accuracy_row`s of modes oracle / infinigen / quest / h2o, InfiniGen's variants, and full
    attention): one line per selection (`SparseKVConfig.selection`) through its budgets, full
    attention as a black star. The oracle's line is dashed: it reads every key to select, so its
    bytes are its selection's, not a saving. Returns the Axes."""
    ax = new_axes(ax)
    for row in rows:
        if row["mode"] == "offload":
            ax.plot(row["fetched_fraction"], row[metric], "k*", markersize=12, label="full")
    names = [m for m in MODE_COLORS if any(r.get("selection", r["mode"]) == m for r in rows)]
    names += sorted(
        {r["selection"] for r in rows if r["mode"] != "offload"} - set(MODE_COLORS)
    )  # InfiniGen's variants
    variants = iter(VARIANT_COLORS * len(names))
    for name in names:
        color = MODE_COLORS.get(name) or next(variants)
        pts = [r for r in rows if r.get("selection", r["mode"]) == name]
        pts.sort(key=lambda r: r["fetched_fraction"])
        label = "oracle (reads every key)" if name == "oracle" else name
        style = "o--" if name == "oracle" else "o-"
        x = [r["fetched_fraction"] for r in pts]
        ax.plot(x, [r[metric] for r in pts], style, color=color, label=label)
    ax.set_xlabel("KV bytes fetched / full attention's")
    ax.set_ylabel({"greedy_agreement": "greedy agreement"}.get(metric, metric))
    ax.legend(frameon=False, fontsize=8)
    return ax


def plot_fetch_bytes(stats: Mapping[str, object], ax=None):
    """Host -> device KV bytes per decode token (`EngineStats.h2d_bytes_per_decode_token`, MiB),
    one bar per run name, each labelled with its ratio to the first. Returns the Axes."""
    ax = new_axes(ax, figsize=(5.0, 3.5))
    names = list(stats)
    mib = np.array([stats[n].h2d_bytes_per_decode_token / 2**20 for n in names])
    bars = ax.bar(names, mib, color=[OTHER_COLOR, SELECTED_COLOR, Q_COLOR][: len(names)])
    for bar, value in zip(bars, mib, strict=True):
        ratio = value / mib[0] if mib[0] else float("nan")
        ax.annotate(
            f"{value:.2f} MiB ({ratio:.2f}x)",
            (bar.get_x() + bar.get_width() / 2, value),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("KV MiB host -> device per decode token")
    return ax
