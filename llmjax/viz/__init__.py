"""Plots for the notebooks in colab/ and the benchmark scripts (matplotlib, the `viz` extra:
`pip install 'llmjax[viz]'`).

Each function takes plain results (RequestOutputs, EngineStats, arrays) and an optional
matplotlib `Axes`, draws on it and returns it, so notebooks compose figures and scripts save them
(`save_figure`). Modules by topic: `latency` (schedulers: per-token latency over time, TBT CDFs,
throughput against the token budget, capacity), `radix` (the prefix cache's tree), `kernels`
(ragged paged attention's metadata, page table and mask), `sharding` (meshes, array shardings,
the pipeline's bubble) and `sparse` (InfiniGen's skewing and speculation, accuracy against bytes).
"""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot, or a clear error naming the extra to install."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "llmjax.viz needs matplotlib: pip install 'llmjax[viz]' (or matplotlib==3.11.2)"
        ) from e
    return plt


def new_axes(ax=None, *, figsize=(6.4, 4.0)):
    """`ax` if given, else the axes of a new figure."""
    if ax is not None:
        return ax
    _, ax = pyplot().subplots(figsize=figsize)
    return ax


def save_figure(fig_or_ax, path: str, *, dpi: int = 120) -> str:
    """Write the figure (or an axes' figure) to `path` (PNG by extension), creating its folder,
    and close it; returns the path."""
    import os

    fig = getattr(fig_or_ax, "figure", fig_or_ax)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return path
