"""The execution timeline of semantic-variable programs (scripts/bench_programs.py --plot_dir,
colab/07_programs.ipynb): one row per task (an output of a call; rows ordered by application,
then dispatch time), a thin line while it is ready
but not yet dispatched (waiting for its inputs' round trip, a cap or a slot), a bar from its
dispatch to its finish, colored by semantic function. Rows come from `ProgramExecutor.records`;
times are seconds since the run's start."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmjax.viz import new_axes, pyplot

_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]  # fmt: skip


def _base(name: str) -> str:
    """'reduce_6' and 'reduce_8' are one function family for colors."""
    head, _, tail = name.rpartition("_")
    return head if tail.isdigit() and head else name


def plot_timeline(records: Sequence[Mapping], t0: float = 0.0, ax=None, title: str = ""):
    """The DAG's execution: rows ordered by application then dispatch time (the module doc)."""
    ax = new_axes(ax, figsize=(8, 4.5))
    rows = sorted(
        (r for r in records if r.get("dispatch") is not None and r.get("finish") is not None),
        key=lambda r: (str(r["app"]), r["dispatch"]),
    )
    families = sorted({_base(r["function"]) for r in rows})
    color = {f: _COLORS[i % len(_COLORS)] for i, f in enumerate(families)}
    for y, r in enumerate(rows):
        ready, start, end = (
            (r.get("ready") or r["dispatch"]) - t0,
            r["dispatch"] - t0,
            r["finish"] - t0,
        )
        c = color[_base(r["function"])]
        if start > ready:
            ax.plot([ready, start], [y, y], color=c, linewidth=1, alpha=0.6)
        ax.barh(y, end - start, left=start, height=0.7, color=c)
    from matplotlib.patches import Patch

    ax.set_xlabel("time (s)")
    ax.set_ylabel("tasks")
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    if families:
        handles = [Patch(color=color[f], label=f) for f in families]
        ax.legend(handles=handles, fontsize="small", loc="lower right")
    return ax


def plot_timelines(runs: Mapping[str, tuple[Sequence[Mapping], float]], title: str = ""):
    """One timeline per run ({name: (records, t0)}), stacked, sharing the time axis."""
    plt = pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (name, (records, t0)) in zip(axes[:, 0], runs.items(), strict=True):
        plot_timeline(records, t0, ax=ax, title=name)
    fig.tight_layout(rect=(0, 0, 1, 0.97) if title else None)
    if title:
        fig.suptitle(title)
    return fig
