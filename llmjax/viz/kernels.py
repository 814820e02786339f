"""Ragged paged attention drawn from its metadata (colab/04_kernels.ipynb).

The metadata is what `llmjax/engine/batch.py` `pack` hands the kernels (`StepInput`, named after
the kernels' arguments): `cu_q_lens` [S + 1], `kv_lens` [S], `page_indices` [S, P], `num_seqs`
[1]. Data helpers (plain numpy, no jax):

  used_pages     pages each sequence reads (cdiv(kv_len, page_size); 0 for padded sequences)
  page_owners    for every physical page of the pool, which (sequence, logical page) read it
  ragged_mask    which keys each flat query row may see: the mask of
                 kernels_pallas/ragged_paged_attention/reference.py, laid out as flat query rows
                 x each sequence's key positions side by side

Plots: `plot_page_table` (the page tables and the physical pool), `plot_ragged_mask` (the mask),
`plot_timings` (kernel against reference, per call).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmjax.viz import new_axes, pyplot

PADDING_COLOR = "#d9d9d9"  # padded query rows, padded page-table entries
RESERVED_COLOR = "#7f7f7f"  # page 0: the sink of padded writes
FREE_COLOR = "#ffffff"


def _colors():
    pyplot()  # the import error that names the extra, if matplotlib is missing
    import matplotlib.colors

    return matplotlib.colors


def _rgba(color):
    return _colors().to_rgba(color)


def seq_color(s: int):
    """The color of sequence `s` in every drawing (matplotlib's tab10 cycle), as RGBA."""
    pyplot()
    import matplotlib

    return matplotlib.colormaps["tab10"](s % 10)


def _lighten(rgba, amount: float = 0.75):
    r, g, b, _ = rgba
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount, 1.0)


def used_pages(kv_lens, num_seqs, page_size: int) -> np.ndarray:
    """[S] pages each sequence reads: cdiv(kv_lens[s], page_size) for s < num_seqs[0], else 0
    (padded sequences read nothing)."""
    kv_lens = np.asarray(kv_lens)
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    out = -(-kv_lens // page_size)
    out[n:] = 0
    return out.astype(np.int64)


def page_owners(page_indices, kv_lens, num_seqs, page_size: int, num_pages: int | None = None):
    """-> list over the pool's pages of [(sequence, logical page), ...]: who reads each physical
    page (empty: free, or page 0 when no sequence reads it). A page read by two sequences is a
    shared prefix page (the prefix cache hands the same page to several requests)."""
    page_indices = np.asarray(page_indices)
    num_pages = int(num_pages if num_pages is not None else page_indices.max() + 1)
    owners: list[list[tuple[int, int]]] = [[] for _ in range(num_pages)]
    for s, m in enumerate(used_pages(kv_lens, num_seqs, page_size)):
        for j in range(int(m)):
            owners[int(page_indices[s, j])].append((s, j))
    return owners


@dataclasses.dataclass(frozen=True)
class RaggedMask:
    """Where each flat query row may attend, with keys of all sequences side by side.

    Columns: sequence 0's keys 0..kv_lens[0]-1, then sequence 1's, ... (real sequences only).
    `visible[t, c]`: row t's query sees key c (same sequence, key position <= query position,
    within the sliding window). `row_seq`/`row_pos`: each row's sequence and position (-1 for
    padding rows); `col_seq`/`col_pos`: each column's sequence and key position; `col_new`:
    the key is one of its sequence's new tokens this step (the last q_len keys)."""

    visible: np.ndarray  # [T, C] bool
    row_seq: np.ndarray  # [T] int
    row_pos: np.ndarray  # [T] int
    col_seq: np.ndarray  # [C] int
    col_pos: np.ndarray  # [C] int
    col_new: np.ndarray  # [C] bool
    num_seqs: int  # real sequences (column blocks)
    sliding_window: int | None = None


def ragged_mask(
    cu_q_lens, kv_lens, num_seqs, sliding_window: int | None = None, num_tokens: int | None = None
) -> RaggedMask:
    """The mask of the ragged paged attention contract (reference.py): sequence s owns rows
    cu_q_lens[s]:cu_q_lens[s+1]; its query i sits at position kv_lens[s] - q_len + i; key j is
    visible iff j <= position and (with a window W) position - j < W. `num_tokens`: the padded
    row count T of the batch (default: the real rows only); rows from cu_q_lens[num_seqs[0]] on
    are padding and see nothing."""
    cu = np.asarray(cu_q_lens, np.int64)
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    T = int(cu[n]) if num_tokens is None else int(num_tokens)
    if int(cu[n]) > T:
        raise ValueError(f"{num_tokens=} is less than the {int(cu[n])} real query rows")
    return _mask(cu, np.asarray(kv_lens, np.int64), n, T, sliding_window)


def _mask(cu, kv_lens, n: int, T: int, sliding_window: int | None) -> RaggedMask:
    col_seq = np.concatenate([np.full(kv_lens[s], s) for s in range(n)] or [np.zeros(0)])
    col_pos = np.concatenate([np.arange(kv_lens[s]) for s in range(n)] or [np.zeros(0)])
    col_seq, col_pos = col_seq.astype(np.int64), col_pos.astype(np.int64)
    q_lens = cu[1 : n + 1] - cu[:n]
    col_new = col_pos >= (kv_lens[:n] - q_lens)[col_seq] if n else np.zeros(0, bool)
    row_seq = np.full(T, -1, np.int64)
    row_pos = np.full(T, -1, np.int64)
    for s in range(n):
        rows = np.arange(cu[s], cu[s + 1])
        row_seq[rows] = s
        row_pos[rows] = kv_lens[s] - q_lens[s] + (rows - cu[s])
    real = row_seq >= 0
    visible = (row_seq[:, None] == col_seq[None, :]) & real[:, None]
    visible &= col_pos[None, :] <= row_pos[:, None]
    if sliding_window is not None:
        visible &= row_pos[:, None] - col_pos[None, :] < sliding_window
    return RaggedMask(visible, row_seq, row_pos, col_seq, col_pos, col_new, n, sliding_window)


# ---------------------------------------------------------------------------------------------


def _seq_label(seq_labels, s: int) -> str:
    return seq_labels[s] if seq_labels is not None and s < len(seq_labels) else f"seq {s}"


def plot_page_table(
    page_indices,
    kv_lens,
    num_seqs,
    page_size: int,
    *,
    num_pages: int | None = None,
    seq_labels=None,
    pool_columns: int = 8,
    fig=None,
):
    """Two panels. Left: the page table `page_indices` [S, P], one row per sequence slot, one
    column per logical page; each cell shows the physical page id, colored by sequence where the
    sequence reads it (its last page says how many of its `page_size` slots hold keys) and grey
    where it is padding (unused entries, padded sequences: page 0, never read). Right: the
    physical KV pool (`num_pages` pages, `pool_columns` per row), each page colored by the
    sequence that reads it and labelled `s<seq>.<logical page>`; page 0 is the reserved sink of
    padded writes; white pages are free. Returns the Figure."""
    plt = pyplot()
    page_indices = np.asarray(page_indices)
    kv_lens = np.asarray(kv_lens)
    S, P = page_indices.shape
    used = used_pages(kv_lens, num_seqs, page_size)
    num_pages = int(num_pages if num_pages is not None else page_indices.max() + 1)
    owners = page_owners(page_indices, kv_lens, num_seqs, page_size, num_pages)
    rows = -(-num_pages // pool_columns)
    if fig is None:
        fig = plt.figure(figsize=(4 + 0.7 * P + 0.8 * pool_columns, 0.6 + 0.5 * max(S, rows)))
    ax_t, ax_p = fig.subplots(1, 2, gridspec_kw={"width_ratios": [P + 2, pool_columns]})

    colors = np.ones((S, P, 4))
    for s in range(S):
        for j in range(P):
            colors[s, j] = seq_color(s) if j < used[s] else _rgba(PADDING_COLOR)
            text = str(int(page_indices[s, j]))
            if j < used[s] and j == used[s] - 1:
                fill = int(kv_lens[s]) - j * page_size
                text += f"\n{fill}/{page_size}"
            ax_t.text(j, s, text, ha="center", va="center", fontsize=8)
    ax_t.imshow(colors, aspect="auto", interpolation="nearest")
    ax_t.set_xticks(range(P), [str(j) for j in range(P)])
    ax_t.set_yticks(
        range(S),
        [
            f"{_seq_label(seq_labels, s)} (kv {int(kv_lens[s])})" if used[s] else f"pad {s}"
            for s in range(S)
        ],
    )
    ax_t.set_xlabel("logical page j (keys j*G .. j*G+G-1)")
    ax_t.set_title("page_indices: physical page of each logical page")
    _grid_lines(ax_t, S, P)

    pool = np.ones((rows, pool_columns, 4))
    for p in range(rows * pool_columns):
        r, c = divmod(p, pool_columns)
        if p >= num_pages:
            pool[r, c] = (1, 1, 1, 0)
            continue
        who = owners[p]
        if who:
            pool[r, c] = seq_color(who[0][0])
            label = f"p{p}\n" + " ".join(f"s{s}.{j}" for s, j in who)
        elif p == 0:
            pool[r, c] = _rgba(RESERVED_COLOR)
            label = "p0\nsink"
        else:
            pool[r, c] = _rgba(FREE_COLOR)
            label = f"p{p}\nfree"
        ax_p.text(c, r, label, ha="center", va="center", fontsize=7)
    ax_p.imshow(pool, aspect="auto", interpolation="nearest")
    ax_p.set_xticks([])
    ax_p.set_yticks([])
    ax_p.set_title(f"the KV pool: {num_pages} pages of {page_size} slots")
    _grid_lines(ax_p, rows, pool_columns)
    fig.tight_layout()
    return fig


def _grid_lines(ax, rows: int, cols: int) -> None:
    for r in range(rows + 1):
        ax.axhline(r - 0.5, color="white", lw=1.5)
    for c in range(cols + 1):
        ax.axvline(c - 0.5, color="white", lw=1.5)


# imshow codes of plot_ragged_mask: 0 another sequence's key, 1 padding row, 2 + 2s a key of
# sequence s that the mask hides from this row, 3 + 2s a key of sequence s this row sees.
def mask_codes(mask: RaggedMask) -> np.ndarray:
    """[T, C] ints that `plot_ragged_mask` colors (see the comment above)."""
    T, C = mask.visible.shape
    codes = np.zeros((T, C), np.int64)
    same = mask.row_seq[:, None] == mask.col_seq[None, :]
    codes[same] = 2 + 2 * mask.col_seq[None, :].repeat(T, 0)[same]
    codes[mask.visible] += 1
    codes[mask.row_seq < 0] = 1
    return codes


def plot_ragged_mask(mask: RaggedMask, ax=None, *, seq_labels=None, title: str | None = None):
    """The attention mask of one ragged step: rows are the flat query tokens (the kernel's q
    rows, padding rows grey at the bottom), columns every sequence's key positions side by side.
    A cell is dark in the sequence's color where the row sees the key, light where the key
    belongs to the row's sequence but is masked (causal, or outside the sliding window), white
    for other sequences' keys. Black boxes mark each sequence's new tokens x new keys: the causal
    triangle of this step's chunk; columns left of it are keys already in the cache. Returns the
    Axes."""
    plt = pyplot()
    ax = new_axes(ax, figsize=(8, 5))
    codes = mask_codes(mask)
    n = mask.num_seqs
    palette = [
        _rgba(FREE_COLOR),
        _rgba(PADDING_COLOR),
    ]
    for s in range(max(n, 1)):
        palette += [_lighten(seq_color(s)), seq_color(s)]
    cmap = _colors().ListedColormap(palette)
    ax.imshow(
        codes,
        cmap=cmap,
        vmin=-0.5,
        vmax=len(palette) - 0.5,
        aspect="auto",
        interpolation="nearest",
    )
    T, C = codes.shape
    starts = [int(np.argmax(mask.col_seq == s)) for s in range(n)]
    for s in range(n):
        rows = np.flatnonzero(mask.row_seq == s)
        new_cols = np.flatnonzero((mask.col_seq == s) & mask.col_new)
        if rows.size and new_cols.size:
            ax.add_patch(
                plt.Rectangle(
                    (new_cols[0] - 0.5, rows[0] - 0.5),
                    new_cols.size,
                    rows.size,
                    fill=False,
                    edgecolor="black",
                    lw=1.2,
                )
            )
        if s:
            ax.axvline(starts[s] - 0.5, color="black", lw=0.6)
    for t in range(1, T):
        if mask.row_seq[t] != mask.row_seq[t - 1]:
            ax.axhline(t - 0.5, color="black", lw=0.6)
    ax.set_xticks(
        [st + (mask.col_seq == s).sum() / 2 - 0.5 for s, st in enumerate(starts)],
        [f"{_seq_label(seq_labels, s)}\nkeys 0..{(mask.col_seq == s).sum() - 1}" for s in range(n)],
        fontsize=8,
    )
    if T <= 40:
        ax.set_yticks(
            range(T),
            [
                f"{t}: s{mask.row_seq[t]} @{mask.row_pos[t]}"
                if mask.row_seq[t] >= 0
                else f"{t}: pad"
                for t in range(T)
            ],
            fontsize=7,
        )
    ax.set_ylabel("flat query row: sequence @ position")
    if title is None:
        title = "causal" if mask.sliding_window is None else f"sliding window {mask.sliding_window}"
        title = f"mask ({title}): {int(mask.visible.sum())} of {T} x {C} (row, key) pairs attend"
    ax.set_title(title, fontsize=10)
    return ax


def plot_timings(times_ms: dict, ax=None, *, title: str | None = None):
    """Horizontal bars: milliseconds per call of each implementation (`times_ms`: name -> ms),
    labelled with the time and the speed-up over the slowest. Returns the Axes."""
    ax = new_axes(ax, figsize=(6.4, 0.6 + 0.5 * max(len(times_ms), 1)))
    names = list(times_ms)
    values = [float(times_ms[k]) for k in names]
    ax.barh(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    slowest = max(values) if values else 1.0
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g} ms ({slowest / v:.1f}x)" if v > 0 else " -", va="center")
    ax.set_xlabel("ms per call")
    ax.set_xlim(0, slowest * 1.35 if values else 1)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
