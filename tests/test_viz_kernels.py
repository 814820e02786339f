"""llmjax/viz/kernels.py: the page-table and mask helpers against the kernels' own behaviour (the
mask's visible cells are exactly where the jnp references attend), and what the plots draw."""

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import jax  # noqa: E402

from kernels_pallas.flash_prefill import flash_prefill_reference  # noqa: E402
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402
from llmjax.viz import kernels  # noqa: E402

G = 4  # page size
NUM_PAGES = 16
Q_LENS = [1, 1, 5, 6]  # two decodes, a chunk starting mid-page (at 6), a whole prompt
KV_LENS = [7, 13, 11, 6]
T, S, P = 16, 6, 4  # padded rows, sequence slots, pages per sequence


def metadata(seed=0):
    """A padded ragged batch over shuffled pages, as batch.pack lays it out."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, NUM_PAGES))
    page_indices = np.zeros((S, P), np.int32)
    used = 0
    for s, k in enumerate(KV_LENS):
        m = -(-k // G)
        page_indices[s, :m] = free[used : used + m]
        used += m
    cu = np.full(S + 1, sum(Q_LENS), np.int32)
    cu[0] = 0
    cu[1 : len(Q_LENS) + 1] = np.cumsum(Q_LENS)
    kv_lens = np.zeros(S, np.int32)
    kv_lens[: len(KV_LENS)] = KV_LENS
    return cu, kv_lens, page_indices, np.array([len(Q_LENS)], np.int32)


def test_used_pages_and_owners():
    _cu, kv_lens, pages, num_seqs = metadata()
    used = kernels.used_pages(kv_lens, num_seqs, G)
    assert used.tolist() == [2, 4, 3, 2, 0, 0]
    owners = kernels.page_owners(pages, kv_lens, num_seqs, G, NUM_PAGES)
    assert owners[0] == []  # the sink is read by nobody
    for s in range(4):
        for j in range(used[s]):
            assert owners[pages[s, j]] == [(s, j)]
    assert sum(len(o) for o in owners) == used.sum()


@pytest.mark.parametrize("window", [None, 3])
def test_mask_is_where_the_reference_attends(window):
    """V rows are one-hot per KV slot, so the reference's output is its attention weights per
    slot: positive exactly where the mask says visible, 0 everywhere else (other sequences'
    pages, masked keys, padding rows)."""
    cu, kv_lens, pages, num_seqs = metadata()
    rng = np.random.default_rng(1)
    K, Qh, H = 2, 2, NUM_PAGES * G  # one value dimension per slot
    q = rng.standard_normal((T, K * Qh, H)).astype(np.float32)
    k = rng.standard_normal((NUM_PAGES, G, K, H)).astype(np.float32)
    v = np.broadcast_to(np.eye(H, dtype=np.float32).reshape(NUM_PAGES, G, 1, H), k.shape)
    reference = jax.jit(
        ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window")
    )
    out = reference(q, k, v, kv_lens, pages, cu, num_seqs, sm_scale=H**-0.5, sliding_window=window)
    weights = np.asarray(out)  # [T, N, slot]
    mask = kernels.ragged_mask(cu, kv_lens, num_seqs, window, num_tokens=T)
    assert mask.visible.shape == (T, sum(KV_LENS))
    # The mask's columns -> the physical slots they live in.
    slot = pages[mask.col_seq, mask.col_pos // G] * G + mask.col_pos % G
    for n in range(K * Qh):
        want = np.zeros((T, NUM_PAGES * G), bool)
        want[:, slot] = mask.visible
        np.testing.assert_array_equal(weights[:, n] > 0, want)
    assert not mask.visible[sum(Q_LENS) :].any() and (mask.row_seq[sum(Q_LENS) :] == -1).all()
    # The decode of sequence 1 sits at position 12; the chunk of sequence 2 starts at 6.
    assert mask.row_pos[:7].tolist() == [6, 12, 6, 7, 8, 9, 10]
    assert mask.col_new.sum() == sum(Q_LENS)


def test_mask_of_one_prompt_is_where_flash_prefill_attends():
    rng = np.random.default_rng(2)
    n, Tp, window = 6, 8, 4
    q = rng.standard_normal((Tp, 2, Tp)).astype(np.float32)
    k = rng.standard_normal((Tp, 1, Tp)).astype(np.float32)
    v = np.eye(Tp, dtype=np.float32)[:, None, :]  # key j -> value e_j
    reference = jax.jit(flash_prefill_reference, static_argnames=("sm_scale", "sliding_window"))
    out = reference(q, k, v, np.array([n], np.int32), sm_scale=0.3, sliding_window=window)
    mask = kernels.ragged_mask([0, n], [n], [1], window, num_tokens=Tp)
    for h in range(2):
        np.testing.assert_array_equal(np.asarray(out)[:, h, :n] > 0, mask.visible)


def test_plot_ragged_mask_draws_the_mask():
    cu, kv_lens, _pages, num_seqs = metadata()
    mask = kernels.ragged_mask(cu, kv_lens, num_seqs, 3, num_tokens=T)
    ax = kernels.plot_ragged_mask(mask, seq_labels=["a", "b", "c", "d"])
    codes = np.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(codes, kernels.mask_codes(mask))
    seen = (codes >= 2) & (codes % 2 == 1)
    np.testing.assert_array_equal(seen, mask.visible)
    assert ((codes == 1) == (mask.row_seq < 0)[:, None]).all()
    # One box per sequence around its new tokens x new keys.
    boxes = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
    assert sorted((b.get_width(), b.get_height()) for b in boxes) == sorted((q, q) for q in Q_LENS)
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["a", "b", "c", "d"]
    matplotlib.pyplot.close("all")


def test_plot_page_table_draws_every_entry_and_page():
    _cu, kv_lens, pages, num_seqs = metadata()
    fig = kernels.plot_page_table(pages, kv_lens, num_seqs, G, num_pages=NUM_PAGES)
    ax_t, ax_p = fig.axes
    texts = [t.get_text().split("\n")[0] for t in ax_t.texts]
    assert texts == [str(p) for p in pages.reshape(-1)]
    # The last used page of each sequence says how full it is.
    fills = [t.get_text().split("\n")[1] for t in ax_t.texts if "\n" in t.get_text()]
    assert fills == ["3/4", "1/4", "3/4", "2/4"]
    colors = np.asarray(ax_t.images[0].get_array())
    for s in range(S):
        for j in range(P):
            want = (
                kernels.seq_color(s)
                if j < kernels.used_pages(kv_lens, num_seqs, G)[s]
                else matplotlib.colors.to_rgba(kernels.PADDING_COLOR)
            )
            np.testing.assert_allclose(colors[s, j], want)
    pool = [t.get_text() for t in ax_p.texts]
    assert len(pool) == NUM_PAGES and pool[0] == "p0\nsink"
    owner = {p: f"s{s}.{j}" for s in range(4) for j, p in enumerate(pages[s]) if p}
    for p, label in enumerate(pool[1:], start=1):
        assert label == f"p{p}\n" + owner.get(p, "free")
    matplotlib.pyplot.close("all")


def test_plot_timings_bars():
    times = {"kernel": 0.5, "reference": 6.0}
    ax = kernels.plot_timings(times, title="x")
    widths = [p.get_width() for p in ax.patches]
    assert widths == [0.5, 6.0]
    assert "12.0x" in ax.texts[0].get_text()
    matplotlib.pyplot.close("all")
