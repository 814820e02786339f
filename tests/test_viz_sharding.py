"""llmjax/viz/sharding.py on 8 fake CPU devices (tests/conftest.py): device grids and shard blocks
against JAX's own placement, the pipeline schedule reconstructed from EngineStats' counters
(equal to what the stages held, bubble and idle fractions equal to EngineStats'), and what the
plots draw."""

import collections
import types

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from llmjax.config import ParallelConfig  # noqa: E402
from llmjax.engine.stats import EngineStats  # noqa: E402
from llmjax.parallel.mesh import make_mesh  # noqa: E402
from llmjax.viz import sharding as viz  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(ParallelConfig(tp=4, pp=2))


def _rects(ax):
    return [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]


def test_device_grid_and_plot_mesh(mesh):
    grid = viz.device_grid(mesh)
    assert grid.shape == (2, 1, 4)  # (pp, ep, tp / ep)
    assert grid.tolist() == [[[d.id for d in row] for row in group] for group in mesh.devices]
    ax = viz.plot_mesh(mesh)
    assert [t.get_text() for t in ax.texts] == [f"dev {i}" for i in grid.reshape(-1)]
    assert len(_rects(ax)) == 8
    assert "pp=2 x tp=4" in ax.get_title()
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize(
    "spec, num_blocks, replicas",
    [(P(None, "tp"), 4, 2), (P("pp", "tp"), 8, 1), (P(), 1, 8), (P("tp", None), 4, 2)],
)
def test_shard_blocks_match_jax_placement(mesh, spec, num_blocks, replicas):
    shape = (8, 12)
    x = jax.device_put(np.random.default_rng(0).standard_normal(shape), NamedSharding(mesh, spec))
    blocks = viz.array_blocks(x)
    assert len(blocks) == num_blocks
    assert all(len(b.devices) == replicas for b in blocks)
    # Every device's shard is the block the helper says it holds.
    where = {d: b for b in blocks for d in b.devices}
    for shard in x.addressable_shards:
        (r0, r1), (c0, c1) = where[shard.device.id].index
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[r0:r1, c0:c1])
    # The blocks tile the array exactly once.
    cover = np.zeros(shape, int)
    for b in blocks:
        (r0, r1), (c0, c1) = b.index
        cover[r0:r1, c0:c1] += 1
    assert (cover == 1).all()


def test_plot_array_sharding_draws_each_block(mesh):
    shape = (4, 6, 8)  # e.g. KV pages [pages, slots, kv heads, ...] cut to 3 dims
    x = jax.device_put(np.ones(shape, np.float32), NamedSharding(mesh, P("pp", None, "tp")))
    blocks = viz.array_blocks(x)
    ax = viz.plot_array_sharding(blocks, shape, dims=(0, 2), dim_names=["pp", "slot", "head"])
    rects = _rects(ax)
    assert len(rects) == 8
    xy = sorted((round(r.get_x(), 3), round(r.get_y(), 3)) for r in rects)
    assert xy == sorted((c / 4, r / 2) for r in range(2) for c in range(4))
    assert sorted(t.get_text() for t in ax.texts) == sorted(
        f"dev {d.id}" for d in mesh.devices.reshape(-1)
    )
    # Projected onto dims (1, 2) the two pp blocks of one column merge: 4 rectangles, 2 devices.
    ax2 = viz.plot_array_sharding(blocks, shape, dims=(1, 2))
    assert len(_rects(ax2)) == 4
    assert all("," in t.get_text() for t in ax2.texts)
    matplotlib.pyplot.close("all")


def test_sharding_table(mesh):
    tree = {
        "w": jax.device_put(np.ones((8, 12), np.float32), NamedSharding(mesh, P(None, "tp"))),
        "norms": [jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P()))],
        "not_an_array": 3,
    }
    rows = {r.name: r for r in viz.sharding_table(tree)}
    assert set(rows) == {"w", "norms.0"}
    assert rows["w"].shard_shape == (8, 3) and rows["w"].replicas == 2
    assert rows["w"].spec == str(P(None, "tp"))
    assert rows["norms.0"].shard_shape == (8,) and rows["norms.0"].replicas == 8


# --- the pipeline schedule -------------------------------------------------------------------

# Micro-batches entering stage 0 at each tick: (prefill tokens, decode tokens); None: nothing.
ENTRIES = [(8, 0), (6, 2), None, (0, 3), (5, 1), None, (0, 4)]


class FakePipelineEngine:
    """An engine that counts like LLMEngine.step with pp > 1 (stage s at tick t holds the
    micro-batch that entered at t - s; the one leaving the last stage is recorded by
    record_step's prefill/decode counts), without a model."""

    def __init__(self, entries, pp):
        self.entries = list(entries)
        self.pp = pp
        self.stats = EngineStats(num_pages=1)
        self.slots = collections.deque()
        self.steps = 0

    def has_unfinished_requests(self):
        return bool(self.entries) or any(s is not None for s in self.slots)

    def step(self):
        self.steps += 1
        if self.steps % 3 == 0:  # a step with nothing to do does not tick (nor count)
            return []
        entry = self.entries.pop(0) if self.entries else None
        self.slots.appendleft(entry)
        while len(self.slots) < self.pp:
            self.slots.append(None)
        self.stats.record_tick([0 if e is None else sum(e) for e in self.slots])
        exiting = self.slots.pop()
        if exiting is None:
            return []
        self.stats.num_prefill_tokens += exiting[0]
        self.stats.num_decode_tokens += exiting[1]
        return [types.SimpleNamespace(request_id=str(self.steps), finished=True)]


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_schedule_from_engine_counters(pp):
    engine = FakePipelineEngine(ENTRIES, pp)
    outputs, ticks = viz.record_pipeline(engine)
    assert len(ticks) == len(ENTRIES) + pp - 1  # fill, then drain
    schedule = viz.pipeline_schedule(ticks, pp)
    real = [e for e in ENTRIES if e is not None]
    assert len(outputs) == len(real)
    for t in range(len(ticks)):
        for s in range(pp):
            e = ENTRIES[t - s] if 0 <= t - s < len(ENTRIES) else None
            assert schedule.tokens[t, s] == (0 if e is None else sum(e))
            assert (schedule.microbatch[t, s] >= 0) == (e is not None)
    assert schedule.prefill_tokens.tolist() == [e[0] for e in real]
    assert schedule.decode_tokens.tolist() == [e[1] for e in real]
    assert [schedule.kind(m) for m in range(len(real))] == [
        "prefill",
        "mixed",
        "decode",
        "mixed",
        "decode",
    ]
    assert schedule.bubble_fraction == pytest.approx(engine.stats.pipeline_bubble_fraction)
    assert schedule.idle_fraction == pytest.approx(engine.stats.pipeline_idle_fraction)
    with pytest.raises(ValueError, match="do not fit"):
        viz.pipeline_schedule(ticks, pp + 1)


@pytest.mark.parametrize("x", ["ticks", "tokens"])
def test_plot_pipeline_schedule_fills_cells_by_tokens(x):
    pp = 2
    _, ticks = viz.record_pipeline(FakePipelineEngine(ENTRIES, pp))
    schedule = viz.pipeline_schedule(ticks, pp)
    ax = viz.plot_pipeline_schedule(schedule, x=x)
    n = len(ticks)
    tick_max = schedule.tokens.max(axis=1)
    width = np.ones(n) if x == "ticks" else tick_max
    start = np.concatenate([[0], np.cumsum(width)])
    drawn = collections.defaultdict(dict)
    for r in _rects(ax):
        if r.get_gid():
            t = int(np.searchsorted(start, r.get_x() + 1e-9, side="right")) - 1
            drawn[r.get_gid()][(t, int(r.get_y()))] = r.get_width()
    assert len(drawn["busy"]) == int((schedule.microbatch >= 0).sum())
    assert len(drawn["idle"]) == int((schedule.microbatch < 0).sum())
    for t in range(n):
        for s in range(pp):
            if schedule.microbatch[t, s] >= 0:
                frac = schedule.tokens[t, s] / tick_max[t]
                assert drawn["busy"][(t, s)] == pytest.approx(width[t] * frac)
                assert drawn["bubble"].get((t, s), 0.0) == pytest.approx(width[t] * (1 - frac))
            else:
                assert drawn["idle"][(t, s)] == pytest.approx(width[t])
    if x == "tokens":  # the light red share of the area is the bubble fraction
        red = sum(drawn["bubble"].values()) + sum(drawn["idle"].values())
        assert red / (start[-1] * pp) == pytest.approx(schedule.bubble_fraction)
    assert sorted(int(t.get_text()) for t in ax.texts) == sorted(
        schedule.microbatch[schedule.microbatch >= 0].tolist()
    )
    assert f"{schedule.bubble_fraction:.1%}" in ax.get_title()
    matplotlib.pyplot.close("all")


def test_plot_bubble_fractions_bars():
    a = EngineStats(num_pages=1)
    a.record_tick([8, 0])
    a.record_tick([2, 8])
    b = EngineStats(num_pages=1)
    b.record_tick([4, 4])
    ax = viz.plot_bubble_fractions({"a": a, "b": b})
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx(
        [a.pipeline_bubble_fraction, b.pipeline_bubble_fraction, 0.25, 0.0]
    )
    matplotlib.pyplot.close("all")
