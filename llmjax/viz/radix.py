"""The prefix cache's radix tree and what it saves (colab/03_prefix_cache.ipynb).

`RadixCache` (llmjax/engine/radix_cache.py) is a tree of page-aligned token runs: each node's
edge is a run of whole KV pages, children are keyed by their first page of token ids, and a
node's `lock_ref` counts the running requests whose shared prefix passes through it. The helpers
here read only its public attributes (`root`, and each `RadixNode`'s `children`, `token_ids`,
`pages`, `lock_ref`, `last_access`, `node_id`), never change it, and return plain data:

  snapshot_tree     the tree now, as a list of `TreeNode`s (root first, parents before
                    children): what the plots draw, kept after the cache moves on
  request_paths     for each node, the requests whose token ids contain the node's whole prefix
                    (the requests that share its pages)
  merge_chains      the same tree with every unbranched chain of nodes (same requests, same
                    lock count) drawn as one node: the cache grows a request's path one page at
                    a time as its chunks and decodes fill pages, so a conversation is a chain
  tree_layout       (x, y) of each node: leaves one unit apart in depth-first order, a parent
                    centred over its children, y = -depth
  evicted_node_ids  the nodes of one snapshot that lost pages by a later one
  sharing_matrix    requests x cached pages: which request's prefix holds which page

Plots: `plot_radix_tree` (the tree, nodes coloured by how many requests share them, locked
nodes outlined), `plot_page_sharing` (the requests x pages matrix), `plot_prefix_hits` (each
request's prompt split into cache hits and computed tokens), `plot_ttft_cache` (TTFT with the
cache off and on, request by request) and `plot_cache_timeline` (cached and evicted pages over a
run with a small cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from llmjax.viz import new_axes, pyplot

OFF_COLOR, ON_COLOR = "tab:gray", "tab:blue"
LOCK_COLOR, EVICT_COLOR = "tab:red", "tab:orange"


@dataclasses.dataclass(frozen=True)
class TreeNode:
    """One node of a radix tree snapshot. `start` is the number of tokens before its edge (the
    prefix it extends), `depth` its edges from the root; the root has node_id of the cache's
    root, parent_id None and no tokens."""

    node_id: int
    parent_id: int | None
    depth: int
    start: int
    token_ids: tuple[int, ...]
    pages: tuple[int, ...]
    lock_ref: int
    last_access: int
    node_ids: tuple[int, ...] = ()  # after `merge_chains`: the tree's nodes this one stands for

    @property
    def num_nodes(self) -> int:
        return max(1, len(self.node_ids))

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Tokens from the root to the end of this node's edge."""
        return self.start + self.num_tokens


# ------------------------------------------------------------------------------------------------
# Data helpers.


def snapshot_tree(cache) -> list[TreeNode]:
    """The nodes of a `RadixCache` (anything with a `root` RadixNode), root first, then depth
    first with children in creation order (`node_id`): a copy that later matches, inserts and
    evictions do not change."""
    root = getattr(cache, "root", None)
    if root is None:
        raise TypeError(f"{type(cache).__name__} has no radix tree (prefix_cache='none'?)")
    nodes: list[TreeNode] = []
    stack = [(root, None, 0, 0)]
    while stack:
        node, parent_id, depth, start = stack.pop()
        nodes.append(
            TreeNode(
                node_id=node.node_id,
                parent_id=parent_id,
                depth=depth,
                start=start,
                token_ids=tuple(node.token_ids),
                pages=tuple(node.pages),
                lock_ref=node.lock_ref,
                last_access=node.last_access,
            )
        )
        children = sorted(node.children.values(), key=lambda c: c.node_id, reverse=True)
        end = start + len(node.token_ids)
        stack.extend((c, node.node_id, depth + 1, end) for c in children)
    return nodes


def _children(nodes: Sequence[TreeNode]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {n.node_id: [] for n in nodes}
    for n in nodes:
        if n.parent_id is not None:
            kids[n.parent_id].append(n.node_id)
    return kids


def request_paths(
    nodes: Sequence[TreeNode], sequences: Mapping[str, Sequence[int]]
) -> dict[int, list[str]]:
    """node_id -> the names of `sequences` (a request's prompt + generated token ids) that
    contain the node's whole prefix, i.e. whose KV for those tokens is (or would be) these pages.
    The root lists every request. `nodes` must list parents before children (as
    `snapshot_tree` does)."""
    seqs = {name: tuple(int(t) for t in ids) for name, ids in sequences.items()}
    paths: dict[int, list[str]] = {}
    for n in nodes:
        if n.parent_id is None:
            paths[n.node_id] = list(seqs)
            continue
        paths[n.node_id] = [
            name for name in paths[n.parent_id] if seqs[name][n.start : n.end] == n.token_ids
        ]
    return paths


def merge_chains(
    nodes: Sequence[TreeNode],
    paths: Mapping[int, Sequence[str]] | None = None,
    separate: Collection[int] = (),
) -> tuple[list[TreeNode], dict[int, list[str]] | None]:
    """(nodes, paths) with each node that is its parent's only child, with the parent's lock
    count, (given `paths`) the parent's requests and the parent's membership of `separate`
    (e.g. `evicted_node_ids`, to keep evicted nodes their own boxes), folded into the parent:
    one `TreeNode` per unbranched run, its edge the concatenated edges, `node_ids` the nodes it
    stands for (in order), `node_id` the topmost's. The root is never merged. `nodes` parents
    first."""
    kids = _children(nodes)
    by_id = {n.node_id: n for n in nodes}
    rep: dict[int, int] = {}  # node id -> the id of the merged node it joins
    groups: dict[int, list[TreeNode]] = {}
    for n in nodes:
        p = n.parent_id
        chained = (
            p is not None
            and by_id[p].parent_id is not None
            and len(kids[p]) == 1
            and by_id[p].lock_ref == n.lock_ref
            and (p in separate) == (n.node_id in separate)
            and (paths is None or list(paths[p]) == list(paths[n.node_id]))
        )
        rep[n.node_id] = rep[p] if chained else n.node_id
        groups.setdefault(rep[n.node_id], []).append(n)
    merged, depth = [], {}
    for r, members in groups.items():  # parents before children, as in `nodes`
        top = members[0]
        parent = None if top.parent_id is None else rep[top.parent_id]
        depth[r] = 0 if parent is None else depth[parent] + 1
        merged.append(
            dataclasses.replace(
                top,
                parent_id=parent,
                depth=depth[r],
                token_ids=tuple(t for m in members for t in m.token_ids),
                pages=tuple(p for m in members for p in m.pages),
                node_ids=tuple(m.node_id for m in members) if len(members) > 1 else (),
            )
        )
    return merged, None if paths is None else {r: list(paths[r]) for r in groups}


def tree_layout(nodes: Sequence[TreeNode]) -> dict[int, tuple[float, float]]:
    """node_id -> (x, y): leaves at x = 0, 1, 2, ... in depth-first order, each parent at the
    midpoint of its first and last child, y = -depth (the root on top)."""
    kids = _children(nodes)
    by_id = {n.node_id: n for n in nodes}
    pos: dict[int, tuple[float, float]] = {}
    next_leaf = [0.0]

    def place(node_id: int) -> float:
        children = kids[node_id]
        if children:
            xs = [place(c) for c in children]
            x = (xs[0] + xs[-1]) / 2
        else:
            x = next_leaf[0]
            next_leaf[0] += 1
        pos[node_id] = (x, -float(by_id[node_id].depth))
        return x

    for root in (n.node_id for n in nodes if n.parent_id is None):
        place(root)
    return pos


def evicted_node_ids(before: Sequence[TreeNode], after: Sequence[TreeNode]) -> set[int]:
    """The nodes of `before` with at least one page that `after` no longer caches (evicted in
    between; a page evicted and reused for other tokens counts as evicted too)."""
    kept = {(p, t) for n in after for p, t in _page_keys(n)}
    return {
        n.node_id
        for n in before
        if n.parent_id is not None and any(k not in kept for k in _page_keys(n))
    }


def _page_keys(n: TreeNode):
    """Each page of `n` with its position and tokens: the same page id holding other tokens is
    another page."""
    size = n.num_tokens // max(n.num_pages, 1)
    for i, p in enumerate(n.pages):
        yield p, (n.start + i * size, n.token_ids[i * size : (i + 1) * size])


def sharing_matrix(
    nodes: Sequence[TreeNode], paths: Mapping[int, Sequence[str]], names: Sequence[str]
) -> tuple[np.ndarray, list[int]]:
    """(matrix [len(names), cached pages] bool, node_id of each column): entry (r, j) is True
    when request names[r]'s prefix holds page j; columns are the cached pages in `nodes` order
    (depth first, so a shared run of pages is one block of columns)."""
    cols = [(n.node_id, p) for n in nodes if n.parent_id is not None for p in n.pages]
    matrix = np.zeros((len(names), len(cols)), bool)
    row = {name: r for r, name in enumerate(names)}
    for j, (node_id, _) in enumerate(cols):
        for name in paths.get(node_id, ()):
            if name in row:
                matrix[row[name], j] = True
    return matrix, [node_id for node_id, _ in cols]


def _snippet(text: str, n: int) -> str:
    text = " ".join(text.replace("\n", " ⏎ ").split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ------------------------------------------------------------------------------------------------
# Plots.


def node_label(
    node: TreeNode,
    requests: Sequence[str] = (),
    decode: Callable[[Sequence[int]], str] | None = None,
    snippet_chars: int = 24,
) -> str:
    """The text of a node's box: pages and tokens, the start of its text (with `decode`), the
    requests sharing it, and its lock count when locked."""
    lines = [f"{node.num_pages} pg · {node.num_tokens} tok"]
    if node.num_nodes > 1:
        lines[0] += f" ({node.num_nodes} nodes)"
    if decode is not None:
        lines.append(repr(_snippet(decode(node.token_ids), snippet_chars)))
    if requests:
        lines.append(" ".join(requests))
    if node.lock_ref:
        lines.append(f"lock_ref {node.lock_ref}")
    return "\n".join(lines)


def plot_radix_tree(
    nodes: Sequence[TreeNode],
    *,
    paths: Mapping[int, Sequence[str]] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    highlight: Collection[int] = (),
    highlight_label: str = "evicted next",
    snippet_chars: int = 24,
    ax=None,
):
    """Draw a `snapshot_tree` (or its `merge_chains`) as a tree: the root on top, one box per
    node (an edge of whole KV pages) labelled by `node_label`, a line from each parent to each
    child. With `paths` (`request_paths`), boxes are shaded by how many requests share the
    node's pages and list them; locked nodes (`lock_ref` > 0: a running request uses their
    pages) get a thick red outline; nodes with an id in `highlight` (e.g. `evicted_node_ids`;
    a merged node when any node it stands for is) are hatched orange. Returns the Axes."""
    plt = pyplot()
    from matplotlib.patches import FancyBboxPatch, Patch

    pos = tree_layout(nodes)
    num_leaves = 1 + round(max((x for x, _ in pos.values()), default=0))
    depth = max((n.depth for n in nodes), default=0)
    ax = new_axes(ax, figsize=(max(6.0, 2.1 * num_leaves), 1.35 * (depth + 1) + 0.5))
    counts = {nid: len(names) for nid, names in (paths or {}).items()}
    max_count = max([counts.get(n.node_id, 0) for n in nodes if n.parent_id is not None] + [1])
    cmap = plt.get_cmap("Blues")
    shade = lambda count: cmap(0.15 + 0.6 * count / max_count)
    width, height = 0.92, 0.74
    by_id = {n.node_id: n for n in nodes}
    any_marked = False
    for n in nodes:
        x, y = pos[n.node_id]
        if n.parent_id is None:
            ax.plot([x], [y], "o", color="black", markersize=6, zorder=3)
            ax.annotate("root", (x, y), xytext=(6, 2), textcoords="offset points", fontsize=8)
            continue
        px, py = pos[n.parent_id]
        top = y + height / 2
        bottom = py - (0 if by_id[n.parent_id].parent_id is None else height / 2)
        ax.plot([px, x], [bottom, top], color="0.45", linewidth=1.0, zorder=1)
        shared = counts.get(n.node_id, 0)
        face = shade(shared) if paths is not None else "0.92"
        locked = n.lock_ref > 0
        marked = any(i in highlight for i in (n.node_id, *n.node_ids))
        any_marked |= marked
        box = FancyBboxPatch(
            (x - width / 2, y - height / 2),
            width,
            height,
            boxstyle="round,pad=0.0,rounding_size=0.06",
            facecolor=face,
            edgecolor=LOCK_COLOR if locked else "0.3",
            linewidth=2.5 if locked else 0.8,
            hatch="///" if marked else None,
            zorder=2,
        )
        if marked:
            box.set_edgecolor(EVICT_COLOR if not locked else LOCK_COLOR)
        ax.add_patch(box)
        names = (paths or {}).get(n.node_id, ())
        label = node_label(n, names, decode, snippet_chars)
        ax.text(x, y, label, ha="center", va="center", fontsize=6.5, zorder=4, wrap=False)
    xs = [x for x, _ in pos.values()]
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_ylim(-depth - 0.6, 0.4)
    ax.set_axis_off()
    handles = []
    if paths is not None:
        for count in sorted({1, max_count}):
            label = f"shared by {count} request{'s' if count > 1 else ''}"
            handles.append(Patch(facecolor=shade(count), edgecolor="0.3", label=label))
    if any(n.lock_ref for n in nodes):
        handles.append(
            Patch(facecolor="white", edgecolor=LOCK_COLOR, linewidth=2.5, label="locked")
        )
    if any_marked:
        handles.append(
            Patch(facecolor="white", edgecolor=EVICT_COLOR, hatch="///", label=highlight_label)
        )
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=7, frameon=False)
    return ax


def plot_page_sharing(
    nodes: Sequence[TreeNode],
    paths: Mapping[int, Sequence[str]],
    names: Sequence[str],
    ax=None,
):
    """Which request's prefix holds which cached page: a requests x pages grid (`sharing_matrix`),
    filled where the request's KV is that page, columns in depth-first order with a line between
    nodes and the node id under each block. A column filled in many rows is a page computed once
    and read by all of them. Returns the Axes."""
    matrix, col_nodes = sharing_matrix(nodes, paths, names)
    ax = new_axes(ax, figsize=(max(6.0, 0.12 * matrix.shape[1] + 2), 0.35 * len(names) + 1.2))
    ax.imshow(matrix, aspect="auto", cmap="Blues", vmin=0, vmax=1.4, interpolation="nearest")
    ax.set_yticks(range(len(names)), list(names))
    bounds = [j for j in range(1, len(col_nodes)) if col_nodes[j] != col_nodes[j - 1]]
    for j in bounds:
        ax.axvline(j - 0.5, color="0.3", linewidth=0.8)
    starts = [0, *bounds]
    ends = [*bounds, len(col_nodes)]
    centers = [(s + e - 1) / 2 for s, e in zip(starts, ends, strict=True)]
    ax.set_xticks(centers, [f"n{col_nodes[s]}" for s in starts], fontsize=7)
    ax.set_xlabel("cached KV pages, node by node (depth first)")
    ax.set_ylabel("request")
    return ax


def _ttft(o) -> float:
    m = o.metrics
    return m.first_token_time - m.arrival_time


def plot_prefix_hits(outputs: Mapping[str, object], ax=None):
    """Each request's prompt tokens split into prefix-cache hits (`num_cached_tokens`, blue) and
    computed tokens (grey), one bar per request; the title gives the hit rate (hit tokens /
    prompt tokens). Returns the Axes."""
    ax = new_axes(ax)
    names = list(outputs)
    hits = np.array([outputs[n].num_cached_tokens for n in names])
    total = np.array([len(outputs[n].prompt_token_ids) for n in names])
    x = np.arange(len(names))
    ax.bar(x, hits, color=ON_COLOR, label="from the cache")
    ax.bar(x, total - hits, bottom=hits, color=OFF_COLOR, label="computed")
    ax.set_xticks(x, names)
    ax.set_ylabel("prompt tokens")
    rate = hits.sum() / max(total.sum(), 1)
    ax.set_title(f"prefix-cache hits: {rate:.0%} of prompt tokens")
    ax.legend(frameon=False)
    return ax


def plot_ttft_cache(outputs_off: Mapping[str, object], outputs_on: Mapping[str, object], ax=None):
    """TTFT (first token time - arrival) of the same requests with the prefix cache off (grey)
    and on (blue), side by side per request (names of `outputs_off`, in order). Returns the
    Axes."""
    ax = new_axes(ax)
    names = list(outputs_off)
    off = np.array([_ttft(outputs_off[n]) for n in names])
    on = np.array([_ttft(outputs_on[n]) for n in names])
    x = np.arange(len(names))
    ax.bar(x - 0.2, off, 0.4, color=OFF_COLOR, label="prefix_cache='none'")
    ax.bar(x + 0.2, on, 0.4, color=ON_COLOR, label="prefix_cache='radix'")
    ax.set_xticks(x, names)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT: mean {off.mean():.2f} s off, {on.mean():.2f} s on")
    ax.legend(frameon=False)
    return ax


def plot_cache_timeline(
    labels: Sequence[str],
    cached_pages: Sequence[int],
    evicted_pages: Sequence[int],
    num_pages: int,
    hit_tokens: Sequence[int] | None = None,
    ax=None,
):
    """A run with a small cache, one point per finished request (`labels`): pages in the prefix
    cache after it (blue), pages evicted so far (orange, cumulative), the usable pages (dashed);
    with `hit_tokens`, each request's cache hit in tokens as grey bars on a second axis. Returns
    the Axes."""
    ax = new_axes(ax)
    x = np.arange(len(labels))
    if hit_tokens is not None:
        twin = ax.twinx()
        twin.bar(x, hit_tokens, 0.5, color="0.85", label="hit (tokens)", zorder=0)
        twin.set_ylabel("prompt tokens from the cache")
        ax.set_zorder(twin.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.plot(x, cached_pages, "o-", color=ON_COLOR, label="cached pages")
    ax.plot(x, evicted_pages, "s-", color=EVICT_COLOR, label="evicted pages (total)")
    ax.axhline(num_pages, color="black", linestyle="--", linewidth=1.0, label="usable pages")
    ax.set_ylim(0, 1.4 * max(num_pages, *cached_pages, *evicted_pages))  # room for the legend
    ax.set_xticks(x, list(labels))
    ax.set_xlabel("after request")
    ax.set_ylabel("KV pages")
    ax.legend(frameon=False, loc="upper left", fontsize=8)
    return ax
