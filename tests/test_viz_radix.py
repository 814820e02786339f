"""llmjax/viz/radix.py: snapshots of a real RadixCache (structure, locks, who shares what), the
tree layout, evictions between snapshots, and what each plot draws."""

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from llmjax.engine.radix_cache import RadixCache  # noqa: E402
from llmjax.engine.request import RequestMetrics, RequestOutput  # noqa: E402
from llmjax.viz import radix  # noqa: E402

PS = 2
# Two requests sharing a 2-page prefix, then diverging; a third sharing nothing.
SEQS = {
    "a": [1, 2, 3, 4, 5, 6, 7, 8],
    "b": [1, 2, 3, 4, 9, 10, 11],  # 3 full pages: the last page (11) is never cached
    "c": [20, 21, 22, 23],
}


@pytest.fixture
def cache():
    c = RadixCache(PS)
    pages = iter(range(1, 100))
    for ids in SEQS.values():
        n = len(ids) // PS
        table = [next(pages) for _ in range(n)]
        c.insert(ids[: n * PS], table)
    c.lock(c.match(SEQS["b"]).node)  # b is "running": its path is locked
    return c


def test_snapshot_is_the_tree(cache):
    nodes = radix.snapshot_tree(cache)
    assert nodes[0].parent_id is None and nodes[0].num_tokens == 0
    inner = [n for n in nodes if n.parent_id is not None]
    # root -> (1 2 3 4) -> {(5 6 7 8), (9 10)}; root -> (20 .. 23)
    assert sorted(n.token_ids for n in inner) == [
        (1, 2, 3, 4),
        (5, 6, 7, 8),
        (9, 10),
        (20, 21, 22, 23),
    ]
    by_tokens = {n.token_ids: n for n in inner}
    shared, tail_b = by_tokens[(1, 2, 3, 4)], by_tokens[(9, 10)]
    assert tail_b.parent_id == shared.node_id and tail_b.start == 4 and tail_b.depth == 2
    assert shared.num_pages == 2 and shared.pages == (1, 2)
    assert (shared.lock_ref, tail_b.lock_ref, by_tokens[(5, 6, 7, 8)].lock_ref) == (1, 1, 0)
    ids = [n.node_id for n in nodes]
    for n in inner:  # parents before children
        assert ids.index(n.parent_id) < ids.index(n.node_id)
    # a copy: the cache moving on leaves the snapshot alone
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 30, 31], [1, 2, 3, 4, 50])
    assert sum(1 for _ in nodes) == 5 and len(radix.snapshot_tree(cache)) == 6


def test_request_paths_and_sharing_matrix(cache):
    nodes = radix.snapshot_tree(cache)
    paths = radix.request_paths(nodes, SEQS)
    by_tokens = {n.token_ids: n.node_id for n in nodes}
    assert paths[by_tokens[()]] == ["a", "b", "c"]
    assert paths[by_tokens[(1, 2, 3, 4)]] == ["a", "b"]
    assert paths[by_tokens[(5, 6, 7, 8)]] == ["a"]
    assert paths[by_tokens[(9, 10)]] == ["b"]
    assert paths[by_tokens[(20, 21, 22, 23)]] == ["c"]
    matrix, col_nodes = radix.sharing_matrix(nodes, paths, ["a", "b", "c"])
    assert matrix.shape == (3, 7)  # 2 + 2 + 1 + 2 cached pages
    assert matrix.sum(axis=1).tolist() == [4, 3, 2]
    assert matrix.sum(axis=0).tolist().count(2) == 2  # the shared prefix's two pages
    assert len(set(col_nodes)) == 4


def test_merge_chains_folds_unbranched_runs():
    """A request decoding page by page grows a chain of one-page nodes; merged, it is one node
    until the requests (or locks) along it change."""
    c = RadixCache(PS)
    ids = list(range(1, 13))  # 6 pages, offered one page at a time
    for n in range(1, 7):
        c.insert(ids[: n * PS], list(range(1, n + 1)))
    c.insert([1, 2, 3, 4, 50, 51], [1, 2, 9])  # another request branches after 2 pages
    nodes = radix.snapshot_tree(c)
    assert len(nodes) == 1 + 7  # pages 1, 2, 3, 4, 5, 6 each a node, and the branch (9)
    merged, _ = radix.merge_chains(nodes)
    edges = sorted((n.token_ids, n.node_ids) for n in merged if n.parent_id is not None)
    by_tokens = {n.token_ids: n for n in nodes}
    top, rest = (1, 2, 3, 4), (5, 6, 7, 8, 9, 10, 11, 12)
    assert [e[0] for e in edges] == [top, rest, (50, 51)]
    assert edges[0][1] == (by_tokens[(1, 2)].node_id, by_tokens[(3, 4)].node_id)
    assert len(edges[1][1]) == 4 and edges[2][1] == ()
    m = {n.token_ids: n for n in merged}
    assert m[rest].parent_id == m[top].node_id and m[rest].depth == 2 and m[rest].start == 4
    assert m[rest].pages == (3, 4, 5, 6) and m[rest].num_nodes == 4
    # with paths: the chain breaks where a request's prefix ends
    seqs = {"long": ids, "short": ids[:8], "branch": [1, 2, 3, 4, 50, 51]}
    merged, paths = radix.merge_chains(nodes, radix.request_paths(nodes, seqs))
    runs = sorted(n.token_ids for n in merged if n.parent_id is not None)
    assert runs == [top, (5, 6, 7, 8), (9, 10, 11, 12), (50, 51)]
    assert paths[m[top].node_id] == ["long", "short", "branch"]
    assert paths == radix.request_paths(merged, seqs)
    # a lock that ends inside a chain breaks it too
    c.lock(c.match(ids[:6]).node)
    merged, _ = radix.merge_chains(radix.snapshot_tree(c))
    locks = sorted((n.token_ids, n.lock_ref) for n in merged if n.parent_id is not None)
    assert locks == [(top, 1), ((5, 6), 1), ((7, 8, 9, 10, 11, 12), 0), ((50, 51), 0)]
    # a node to keep apart (say, evicted next) ends its chain's box and gets its own
    last = by_tokens[(11, 12)].node_id
    parts, _ = radix.merge_chains(radix.snapshot_tree(c), separate={last})
    runs = {n.token_ids for n in parts if n.parent_id is not None}
    assert {(7, 8, 9, 10), (11, 12)} <= runs and (7, 8, 9, 10, 11, 12) not in runs
    ax = radix.plot_radix_tree(merged, highlight={last})
    assert sum(1 for p in ax.patches if isinstance(p, FancyBboxPatch) and p.get_hatch()) == 1
    assert any("(3 nodes)" in t.get_text() for t in ax.texts)
    plt.close("all")


def test_layout_centres_parents_over_children(cache):
    nodes = radix.snapshot_tree(cache)
    pos = radix.tree_layout(nodes)
    kids = {}
    for n in nodes:
        if n.parent_id is not None:
            kids.setdefault(n.parent_id, []).append(n.node_id)
    leaves = sorted(pos[n.node_id][0] for n in nodes if n.node_id not in kids)
    assert leaves == [0.0, 1.0, 2.0]
    for parent, children in kids.items():
        xs = [pos[c][0] for c in children]
        assert pos[parent][0] == pytest.approx((xs[0] + xs[-1]) / 2)
        assert all(pos[c][1] == pos[parent][1] - 1 for c in children)


def test_evicted_nodes(cache):
    before = radix.snapshot_tree(cache)
    freed = cache.evict(1)  # the LRU unlocked leaf
    after = radix.snapshot_tree(cache)
    gone = radix.evicted_node_ids(before, after)
    assert len(gone) == 1
    (node,) = [n for n in before if n.node_id in gone]
    assert set(node.pages) == set(freed) and node.lock_ref == 0
    assert radix.evicted_node_ids(before, before) == set()


def test_plot_radix_tree_draws_every_node_and_edge(cache):
    nodes = radix.snapshot_tree(cache)
    paths = radix.request_paths(nodes, SEQS)
    ax = radix.plot_radix_tree(
        nodes,
        paths=paths,
        decode=lambda ids: " ".join(map(str, ids)),
        highlight={nodes[-1].node_id},
    )
    boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    assert len(boxes) == len(nodes) - 1
    assert len(ax.lines) == len(nodes)  # one edge per non-root node + the root's dot
    texts = [t.get_text() for t in ax.texts]
    assert "2 pg · 4 tok\n'1 2 3 4'\na b\nlock_ref 1" in texts
    assert any(t.startswith("1 pg · 2 tok\n'9 10'\nb") for t in texts)
    locked = [b for b in boxes if b.get_linewidth() > 2]
    assert len(locked) == 2
    assert sum(1 for b in boxes if b.get_hatch()) == 1
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {
        "shared by 1 request",
        "shared by 2 requests",
        "locked",
        "evicted next",
    }
    plt.close("all")


def test_plot_page_sharing(cache):
    nodes = radix.snapshot_tree(cache)
    paths = radix.request_paths(nodes, SEQS)
    ax = radix.plot_page_sharing(nodes, paths, ["a", "b", "c"])
    image = ax.get_images()[0].get_array()
    np.testing.assert_array_equal(image, radix.sharing_matrix(nodes, paths, ["a", "b", "c"])[0])
    assert len(ax.lines) == 3  # node boundaries
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    plt.close("all")


def _output(name, prompt_len, cached, arrival, first_token):
    m = RequestMetrics(arrival_time=arrival)
    m.first_token_time = first_token
    return RequestOutput(
        request_id=name,
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        token_ids=[1],
        text="",
        finished=True,
        finish_reason="length",
        metrics=m,
        num_cached_tokens=cached,
    )


def test_hit_and_ttft_plots():
    rng = np.random.default_rng(0)
    lens = rng.integers(40, 90, 4)
    hits = [0, 32, 16, 48]
    on = {
        f"r{i}": _output(f"r{i}", int(n), h, 10.0, 10.0 + 0.1 * (n - h))
        for i, (n, h) in enumerate(zip(lens, hits, strict=True))
    }
    off = {
        k: _output(k, len(o.prompt_token_ids), 0, 5.0, 5.0 + 0.1 * len(o.prompt_token_ids))
        for k, o in on.items()
    }
    ax = radix.plot_prefix_hits(on)
    bars = ax.patches
    assert [b.get_height() for b in bars[:4]] == hits
    assert [b.get_height() + h for b, h in zip(bars[4:], hits, strict=True)] == list(lens)
    assert f"{sum(hits) / lens.sum():.0%}" in ax.get_title()
    ax = radix.plot_ttft_cache(off, on)
    heights = [b.get_height() for b in ax.patches]
    np.testing.assert_allclose(heights[:4], 0.1 * lens)
    np.testing.assert_allclose(heights[4:], 0.1 * (lens - np.array(hits)))
    ax = radix.plot_cache_timeline(["r0", "r1", "r2"], [3, 5, 5], [0, 0, 2], 6, [0, 4, 8])
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), [3, 5, 5])
    np.testing.assert_array_equal(ax.lines[1].get_ydata(), [0, 0, 2])
    assert ax.lines[2].get_ydata()[0] == 6
    plt.close("all")


def test_snapshot_needs_a_radix_tree():
    from llmjax.engine.radix_cache import NoPrefixCache

    with pytest.raises(TypeError, match="no radix tree"):
        radix.snapshot_tree(NoPrefixCache(PS))
