"""Meshes, array shardings and the pipeline's bubble, drawn (colab/05_sharding.ipynb).

Data helpers:
  device_grid       a mesh's device ids laid out like the mesh ([pp, ep, tp / ep])
  shard_blocks      which devices hold which block of an array (from its sharding)
  sharding_table    every array of a pytree: shape, PartitionSpec, per-device shard shape
  record_pipeline   drive an engine to completion, keeping its pipeline counters after each tick
  pipeline_schedule from those counters, which micro-batch each stage works on at every tick

Plots: `plot_mesh`, `plot_array_sharding`, `plot_pipeline_schedule` (a Gantt chart of stages x
ticks), `plot_bubble_fractions`.

The pipeline schedule needs no hook in the engine: `EngineStats.record_tick` adds each tick's
stage token counts to `pipeline_stage_tokens`, and at tick t stage s holds the micro-batch that
entered at tick t - s (llmjax/parallel/pipeline.py), so the tokens of the micro-batch entering at
tick t are that tick's increase minus the tokens of the pp - 1 micro-batches that entered before.
The prefill and decode tokens a tick adds (`record_step` of the micro-batch leaving the last
stage) say what each micro-batch held.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmjax.viz import new_axes, pyplot


def device_grid(mesh) -> np.ndarray:
    """The ids of `mesh.devices` (an array of devices shaped like the mesh)."""
    return np.vectorize(lambda d: d.id, otypes=[np.int64])(np.asarray(mesh.devices))


def _device_color(i: int):
    """Device i's color in every drawing (matplotlib's tab10 cycle)."""
    pyplot()
    import matplotlib

    return matplotlib.colormaps["tab10"](i % 10)


def plot_mesh(mesh, ax=None, *, title: str | None = None):
    """The mesh as a grid: one cell per device (its id), rows along the first mesh axis (pp:
    pipeline stages), columns along the rest (the tensor-parallel devices, ep x tp / ep). Cell
    colors are the device colors `plot_array_sharding` uses. Returns the Axes."""
    grid = device_grid(mesh)
    if grid.ndim == 1:
        grid = grid[None]
    names = tuple(getattr(mesh, "axis_names", ("rows", "cols")))
    if grid.ndim > 2:  # ('pp', 'ep', 'tp'): the tensor-parallel devices ep x tp in one row
        grid = grid.reshape(grid.shape[0], -1)
        live = [n for n in names[1:] if mesh.shape[n] > 1] or [names[-1]]
        names = (names[0], " x ".join(f"'{n}'" for n in live).strip("'"))
    ax = new_axes(ax, figsize=(1.2 * grid.shape[1] + 1.5, 1.0 * grid.shape[0] + 1.0))
    rows, cols = grid.shape
    for r in range(rows):
        for c in range(cols):
            ax.add_patch(
                pyplot().Rectangle(
                    (c, r), 1, 1, facecolor=_device_color(int(grid[r, c])), edgecolor="white"
                )
            )
            ax.text(c + 0.5, r + 0.5, f"dev {grid[r, c]}", ha="center", va="center", color="w")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xticks([c + 0.5 for c in range(cols)], [str(c) for c in range(cols)])
    ax.set_yticks([r + 0.5 for r in range(rows)], [str(r) for r in range(rows)])
    ax.set_xlabel(f"'{names[-1]}' index")
    ax.set_ylabel(f"'{names[0]}' index")
    ax.set_aspect("equal")
    shape = " x ".join(  # axes of size 1 but the first left out ('ep' of a dense model)
        f"{n}={s}" for i, (n, s) in enumerate(dict(mesh.shape).items()) if s > 1 or i == 0
    )
    ax.set_title(title or f"mesh {shape}", fontsize=10)
    return ax


@dataclasses.dataclass(frozen=True)
class ShardBlock:
    """One block of an array: `index` = (start, stop) per dimension; `devices`: the ids of every
    device that holds this block (more than one: replicated)."""

    index: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]


def shard_blocks(sharding, shape) -> list[ShardBlock]:
    """The distinct blocks of an array of `shape` under `sharding` (any jax.sharding.Sharding),
    each with the devices that hold it, ordered by position."""
    by_index: dict[tuple, list[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        key = tuple(
            (sl.start or 0, size if sl.stop is None else sl.stop)
            for sl, size in zip(index, shape, strict=True)
        )
        by_index.setdefault(key, []).append(device.id)
    return [ShardBlock(k, tuple(sorted(v))) for k, v in sorted(by_index.items())]


def array_blocks(x) -> list[ShardBlock]:
    """`shard_blocks` of a jax.Array's own sharding."""
    return shard_blocks(x.sharding, x.shape)


@dataclasses.dataclass(frozen=True)
class ShardingRow:
    name: str  # path in the tree, e.g. 'layers.0.wq'
    shape: tuple[int, ...]
    dtype: str
    spec: str  # the PartitionSpec, e.g. "P(None, 'tp', None)"
    shard_shape: tuple[int, ...]  # what one device holds
    replicas: int  # devices holding each block


def _path_name(path) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return ".".join(parts)


def sharding_table(tree) -> list[ShardingRow]:
    """One row per array leaf of `tree` (weights, KV pages): its sharding as a PartitionSpec
    (or the sharding's repr when it has none), the shape of one device's shard and how many
    devices hold each block."""
    import jax

    rows = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(x, "sharding"):
            continue
        spec = getattr(x.sharding, "spec", None)
        blocks = array_blocks(x)
        rows.append(
            ShardingRow(
                name=_path_name(path),
                shape=tuple(x.shape),
                dtype=str(x.dtype),
                spec=str(spec) if spec is not None else repr(x.sharding),
                shard_shape=tuple(x.sharding.shard_shape(x.shape)),
                replicas=len(blocks[0].devices) if blocks else 0,
            )
        )
    return rows


def _devices_label(devices) -> str:
    d = list(devices)
    if len(d) > 2 and d == list(range(d[0], d[0] + len(d))):
        return f"dev {d[0]}-{d[-1]}"
    return "dev " + ",".join(str(i) for i in d)


def plot_array_sharding(
    blocks,
    shape,
    *,
    dims: tuple[int, ...] = (0, 1),
    dim_names=None,
    ax=None,
    title: str | None = None,
):
    """Which device holds which block of an array: the array drawn over two of its dimensions
    (`dims`: rows, columns; one for a vector), each block a rectangle labelled with the devices
    holding it and colored by its first device (as in `plot_mesh`). Axes are in fractions of each
    dimension with ticks at the block boundaries, so a [49152, 576] embedding reads like a
    [4, 64] page table. Blocks that differ only in undrawn dimensions are merged. Returns the
    Axes."""
    plt = pyplot()
    blocks = blocks if isinstance(blocks, list) else array_blocks(blocks)
    shape = tuple(shape)
    dims = tuple(dims)
    if len(dims) == 1:
        dims = (None, dims[0])
    ax = new_axes(ax, figsize=(4.5, 3.2))
    merged: dict[tuple, list[int]] = {}
    for b in blocks:
        rows = (0, 1) if dims[0] is None else b.index[dims[0]]
        cols = b.index[dims[1]]
        merged.setdefault((rows, cols), []).extend(b.devices)
    row_size = 1 if dims[0] is None else shape[dims[0]]
    col_size = shape[dims[1]]
    for (rows, cols), devices in merged.items():
        devices = sorted(set(devices))
        y0, y1 = rows[0] / row_size, rows[1] / row_size
        x0, x1 = cols[0] / col_size, cols[1] / col_size
        ax.add_patch(
            plt.Rectangle(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                facecolor=_device_color(devices[0]),
                edgecolor="white",
                lw=2,
            )
        )
        ax.text(
            (x0 + x1) / 2,
            (y0 + y1) / 2,
            _devices_label(devices),
            ha="center",
            va="center",
            color="white",
            fontsize=8,
            rotation=90 if (x1 - x0) < 0.2 and (y1 - y0) > 0.3 else 0,
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(1, 0)
    names = dim_names or [f"dim {d}" for d in range(len(shape))]
    xs = sorted({c for (_, cols) in merged for c in cols})
    ax.set_xticks([c / col_size for c in xs], [str(c) for c in xs], fontsize=7)
    ax.set_xlabel(f"{names[dims[1]]} ({col_size})")
    if dims[0] is None:
        ax.set_yticks([])
    else:
        ys = sorted({r for (rows, _) in merged for r in rows})
        ax.set_yticks([r / row_size for r in ys], [str(r) for r in ys], fontsize=7)
        ax.set_ylabel(f"{names[dims[0]]} ({row_size})")
    if title:
        ax.set_title(title, fontsize=9)
    return ax


# ---------------------------------------------------------------------------------------------
# The pipeline's schedule


_COUNTERS = (
    "num_pipeline_ticks",
    "pipeline_stage_tokens",
    "pipeline_capacity_tokens",
    "num_idle_stage_ticks",
    "num_prefill_tokens",
    "num_decode_tokens",
)


@dataclasses.dataclass(frozen=True)
class TickCounters:
    """How much one engine step (one pipeline tick) added to the engine's counters."""

    stage_tokens: int  # tokens over all stages
    capacity_tokens: int  # pp x the tick's largest micro-batch
    idle_stages: int  # stages with no micro-batch
    prefill_tokens: int  # of the micro-batch that left the last stage (0 if none left)
    decode_tokens: int


def _snapshot(stats) -> dict:
    return {k: int(getattr(stats, k)) for k in _COUNTERS}


def record_pipeline(engine, max_steps: int = 100_000):
    """Step `engine` (an LLMEngine with pp > 1 and requests added, its pipeline empty) until
    every request is done, keeping what each tick added to `engine.stats`. Returns
    (outputs: {request_id: finished RequestOutput}, ticks: [TickCounters])."""
    outputs, ticks = {}, []
    before = _snapshot(engine.stats)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        after = _snapshot(engine.stats)
        d = {k: after[k] - before[k] for k in _COUNTERS}
        before = after
        if d["num_pipeline_ticks"] == 0:
            continue
        if d["num_pipeline_ticks"] != 1:
            raise ValueError(f"one step ran {d['num_pipeline_ticks']} ticks")
        ticks.append(
            TickCounters(
                stage_tokens=d["pipeline_stage_tokens"],
                capacity_tokens=d["pipeline_capacity_tokens"],
                idle_stages=d["num_idle_stage_ticks"],
                prefill_tokens=d["num_prefill_tokens"],
                decode_tokens=d["num_decode_tokens"],
            )
        )
    else:
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
    return outputs, ticks


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Which micro-batch each stage works on at every tick.

    `microbatch[t, s]`: the id (0, 1, ... in order of entry) of the micro-batch in stage s at
    tick t, -1 if the stage is empty; `tokens[t, s]` its tokens. Per micro-batch:
    `prefill_tokens`, `decode_tokens`, `entry_tick`."""

    microbatch: np.ndarray  # [ticks, pp] int
    tokens: np.ndarray  # [ticks, pp] int
    prefill_tokens: np.ndarray  # [num_microbatches]
    decode_tokens: np.ndarray  # [num_microbatches]
    entry_tick: np.ndarray  # [num_microbatches]

    @property
    def pp(self) -> int:
        return self.tokens.shape[1]

    @property
    def bubble_fraction(self) -> float:
        """1 - computed tokens / (pp x each tick's largest micro-batch): EngineStats'
        pipeline_bubble_fraction over these ticks."""
        cap = self.pp * self.tokens.max(axis=1).sum()
        return 1.0 - self.tokens.sum() / cap if cap else 0.0

    @property
    def idle_fraction(self) -> float:
        """Empty (tick, stage) pairs: EngineStats' pipeline_idle_fraction over these ticks."""
        return float((self.microbatch < 0).mean()) if self.microbatch.size else 0.0

    def kind(self, m: int) -> str:
        """'decode' (only decodes), 'prefill' (only prompt tokens) or 'mixed'."""
        if self.prefill_tokens[m] == 0:
            return "decode"
        return "prefill" if self.decode_tokens[m] == 0 else "mixed"


def pipeline_schedule(ticks: list[TickCounters], pp: int) -> PipelineSchedule:
    """Reconstruct the schedule from per-tick counters (see the module doc). Checks every tick's
    idle stages and capacity against the reconstruction; raises ValueError if they disagree (the
    pipeline was not empty when recording started, or pp is wrong)."""
    n = len(ticks)
    entering = np.zeros(n, np.int64)  # tokens of the micro-batch entering at tick t (0: none)
    for t, tick in enumerate(ticks):
        earlier = entering[max(0, t - pp + 1) : t].sum()
        entering[t] = tick.stage_tokens - earlier
        stages = [entering[t - s] if t - s >= 0 else 0 for s in range(pp)]
        if (
            entering[t] < 0
            or sum(x == 0 for x in stages) != tick.idle_stages
            or pp * max(stages) != tick.capacity_tokens
        ):
            raise ValueError(
                f"tick {t}: counters {tick} do not fit a pipeline of {pp} stages that started "
                f"empty (reconstructed stage tokens {stages})"
            )
    ids = np.full(n, -1, np.int64)
    ids[entering > 0] = np.arange(int((entering > 0).sum()))
    microbatch = np.full((n, pp), -1, np.int64)
    tokens = np.zeros((n, pp), np.int64)
    for t in range(n):
        for s in range(pp):
            if t - s >= 0:
                microbatch[t, s] = ids[t - s]
                tokens[t, s] = entering[t - s]
    entry = np.flatnonzero(entering > 0)
    prefill = np.zeros(entry.size, np.int64)
    decode = np.zeros(entry.size, np.int64)
    for m, t0 in enumerate(entry):
        t_exit = t0 + pp - 1
        if t_exit < n:
            prefill[m] = ticks[t_exit].prefill_tokens
            decode[m] = ticks[t_exit].decode_tokens
    return PipelineSchedule(microbatch, tokens, prefill, decode, entry)


KIND_COLORS = {"decode": "C0", "mixed": "C1", "prefill": "C2"}
BUBBLE_COLOR = "#f4c7c3"  # stage time lost: padding to the tick's largest micro-batch, idle


def plot_pipeline_schedule(
    schedule: PipelineSchedule, ax=None, *, max_ticks: int | None = None, x: str = "ticks"
):
    """A Gantt chart: one row per stage, one column per tick (the first `max_ticks`). A stage's
    cell is filled from the left in proportion to its micro-batch's tokens over the tick's
    largest micro-batch, colored by what the micro-batch holds (decodes only, prefill only,
    mixed) and labelled with its id; every stage of a tick runs at that largest size, so the
    rest of the cell (light red) is bubble. Empty stage-ticks (pipeline fill and drain, nothing
    schedulable) are hatched light red: bubble too. One id running down the diagonal is a
    micro-batch passing the stages.

    x='ticks': every tick one unit wide (the order of events). x='tokens': every tick as wide
    as its largest micro-batch's tokens (token count standing in for time, as EngineStats
    counts it), so the light red share of the area is exactly `bubble_fraction`. Returns the
    Axes."""
    if x not in ("ticks", "tokens"):
        raise ValueError(f"{x=} must be 'ticks' or 'tokens'")
    plt = pyplot()
    n = schedule.tokens.shape[0] if max_ticks is None else min(max_ticks, schedule.tokens.shape[0])
    pp = schedule.pp
    tick_max = schedule.tokens[:n].max(axis=1)
    widths = np.ones(n) if x == "ticks" else tick_max.astype(float)
    starts = np.concatenate([[0.0], np.cumsum(widths)])
    ax = new_axes(ax, figsize=(min(2 + 0.35 * n, 16), 1 + 0.6 * pp))
    min_label_width = starts[-1] / 60

    def add(x0, y, width, gid, **kw):
        patch = plt.Rectangle((x0, y), width, 1, **kw)
        patch.set_gid(gid)  # tests find what was drawn by this id
        ax.add_patch(patch)

    for t in range(n):
        x0, w = starts[t], widths[t]
        for s in range(pp):
            m = schedule.microbatch[t, s]
            if m < 0:
                add(x0, s, w, "idle", facecolor=BUBBLE_COLOR, hatch="///", edgecolor="white")
                continue
            filled = w * schedule.tokens[t, s] / tick_max[t]
            add(x0, s, filled, "busy", facecolor=KIND_COLORS[schedule.kind(m)], edgecolor="none")
            if filled < w:
                add(x0 + filled, s, w - filled, "bubble", facecolor=BUBBLE_COLOR, edgecolor="none")
            if w >= min_label_width:
                ax.text(x0 + w / 2, s + 0.5, str(m), ha="center", va="center", fontsize=7)
        ax.axvline(x0, color="white", lw=0.8)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c) for c in KIND_COLORS.values()]
    handles += [
        plt.Rectangle((0, 0), 1, 1, facecolor=BUBBLE_COLOR),
        plt.Rectangle((0, 0), 1, 1, facecolor=BUBBLE_COLOR, hatch="///", edgecolor="white"),
    ]
    ax.legend(
        handles,
        [f"{k} micro-batch" for k in KIND_COLORS]
        + ["bubble (padded to the\ntick's largest micro-batch)", "idle stage"],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    ax.set_xlim(0, starts[-1])
    ax.set_ylim(pp, 0)
    ax.set_yticks([s + 0.5 for s in range(pp)], [f"stage {s}" for s in range(pp)])
    ax.set_xlabel(
        "tick (one engine step)"
        if x == "ticks"
        else "stage time in tokens (each tick as long as its largest micro-batch)"
    )
    shown = "" if n == schedule.tokens.shape[0] else f" (first {n} of {schedule.tokens.shape[0]})"
    ax.set_title(
        f"pipeline schedule, {pp} stages{shown}: bubble {schedule.bubble_fraction:.1%} of stage "
        f"time, {schedule.idle_fraction:.1%} of stage-ticks idle",
        fontsize=10,
    )
    return ax


def plot_bubble_fractions(results: dict, ax=None, *, title: str | None = None):
    """Grouped bars per run (`results`: name -> EngineStats, or anything with
    `pipeline_bubble_fraction` and `pipeline_idle_fraction`): the bubble (stage time spent
    waiting for the tick's largest micro-batch, in tokens) and the idle share (empty
    stage-ticks). Returns the Axes."""
    names = list(results)
    ax = new_axes(ax, figsize=(1.6 + 1.5 * len(names), 3.2))
    x = np.arange(len(names))
    bubble = [results[k].pipeline_bubble_fraction for k in names]
    idle = [results[k].pipeline_idle_fraction for k in names]
    ax.bar(x - 0.2, bubble, 0.4, label="pipeline_bubble_fraction", color="C3")
    ax.bar(x + 0.2, idle, 0.4, label="pipeline_idle_fraction", color="0.6")
    for i in range(len(names)):
        ax.text(x[i] - 0.2, bubble[i], f"{bubble[i]:.0%}", ha="center", va="bottom", fontsize=8)
        ax.text(x[i] + 0.2, idle[i], f"{idle[i]:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
