"""llmjax/viz/latency.py: the per-token timeline and CDF helpers against the serving metrics of
llmjax.bench (the gaps are summarize's TBT sample), and what each plot draws."""

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from llmjax.bench import CapacityResult, summarize  # noqa: E402
from llmjax.engine.request import RequestMetrics, RequestOutput  # noqa: E402
from llmjax.viz import latency  # noqa: E402

T0 = 1000.0  # perf_counter origin of the fake runs


def fake_outputs(seed=0, num_requests=5, long_prompt_len=64):
    """Random finished requests (arrivals, prompt lengths, token times) and one rejected one."""
    rng = np.random.default_rng(seed)
    outs = []
    for i in range(num_requests):
        arrival = T0 + rng.uniform(0, 2)
        scheduled = arrival + rng.uniform(0.001, 0.3)
        n = int(rng.integers(1, 9))
        times = scheduled + np.cumsum(rng.uniform(0.01, 0.5, n))
        prompt_len = long_prompt_len if i % 2 else 8
        outs.append(
            RequestOutput(
                request_id=str(i),
                prompt=None,
                prompt_token_ids=list(range(prompt_len)),
                token_ids=list(range(n)),
                text="",
                finished=True,
                finish_reason="length",
                metrics=RequestMetrics(
                    arrival_time=arrival,
                    first_scheduled_time=scheduled,
                    first_token_time=float(times[0]),
                    finished_time=float(times[-1]),
                    token_times=[float(t) for t in times],
                ),
            )
        )
    outs.append(
        RequestOutput(
            request_id="bad",
            prompt=None,
            prompt_token_ids=[],
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            metrics=RequestMetrics(arrival_time=T0 + 0.5, finished_time=T0 + 0.5),
            error="empty prompt",
        )
    )
    return outs


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ---- data helpers ------------------------------------------------------------------------------


def test_token_gaps_are_summarize_tbt_sample():
    outs = fake_outputs()
    g = latency.token_gaps(outs)
    start = min(o.metrics.arrival_time for o in outs)
    expected = sorted(
        (t - start, t - prev, i)
        for i, o in enumerate(outs)
        for prev, t in zip(o.metrics.token_times, o.metrics.token_times[1:], strict=False)
    )
    np.testing.assert_allclose(g.times, [e[0] for e in expected])
    np.testing.assert_allclose(g.gaps, [e[1] for e in expected])
    np.testing.assert_array_equal(g.request, [e[2] for e in expected])
    assert np.all(np.diff(g.times) >= 0) and np.all(g.gaps > 0)
    s = summarize(outs)
    assert s.tbt.count == len(g.gaps)
    assert np.isclose(s.tbt.max, g.gaps.max()) and np.isclose(s.tbt.p99, np.percentile(g.gaps, 99))
    shifted = latency.token_gaps(outs, t0=start - 1.0)
    np.testing.assert_allclose(shifted.times, g.times + 1.0)


def test_token_gaps_of_nothing():
    g = latency.token_gaps(fake_outputs()[-1:])  # only the rejected request
    assert len(g.times) == len(g.gaps) == len(g.request) == 0


def test_ecdf():
    values = np.random.default_rng(1).exponential(1.0, 37)
    x, y = latency.ecdf(values)
    np.testing.assert_array_equal(x, np.sort(values))
    for q in (0.1, 0.5, 2.0):
        k = np.searchsorted(x, q, side="right")  # the CDF at q = fraction <= q
        assert np.isclose(y[k - 1] if k else 0.0, np.mean(values <= q))
    assert y[-1] == 1.0 and np.all(np.diff(y) > 0)
    ex, ey = latency.ecdf([])
    assert len(ex) == len(ey) == 0


def test_long_prompt_arrivals():
    outs = fake_outputs(long_prompt_len=64)
    got = latency.long_prompt_arrivals(outs, 64)
    start = min(o.metrics.arrival_time for o in outs)
    want = sorted(o.metrics.arrival_time - start for o in outs if len(o.prompt_token_ids) >= 64)
    np.testing.assert_allclose(got, want)
    assert len(got) == 2


def test_run_color():
    assert latency.run_color("prefill_first") == latency.run_color("prefill_first/radix/lpm")
    assert latency.run_color("sarathi") != latency.run_color("prefill_first")
    assert latency.run_color("x", 0) != latency.run_color("y", 1)


# ---- plots -------------------------------------------------------------------------------------


def test_plot_token_latency_draws_every_gap():
    outs = fake_outputs()
    ax = latency.plot_token_latency(outs, label="sarathi", tbt_slo=0.25, mark_prompts_from=64)
    g = latency.token_gaps(outs)
    dots = ax.lines[0]
    np.testing.assert_allclose(dots.get_xdata(), g.times)
    np.testing.assert_allclose(dots.get_ydata(), 1e3 * g.gaps)
    assert dots.get_label() == "sarathi"
    verticals = [ln for ln in ax.lines[1:] if ln.get_linestyle() == ":"]
    np.testing.assert_allclose(
        [ln.get_xdata()[0] for ln in verticals], latency.long_prompt_arrivals(outs, 64)
    )
    slo = [ln for ln in ax.lines if ln.get_label().startswith("TBT SLO")]
    assert len(slo) == 1 and np.allclose(slo[0].get_ydata(), 250.0)


def test_plot_token_latency_panels_one_per_run():
    runs = {"sarathi": fake_outputs(0), "prefill_first": fake_outputs(1), "x": fake_outputs(2)}
    fig = latency.plot_token_latency_panels(runs, tbt_slo=0.1)
    assert len(fig.axes) == 3
    for ax, (name, outs) in zip(fig.axes, runs.items(), strict=True):
        assert ax.get_title() == name
        np.testing.assert_allclose(ax.lines[0].get_ydata(), 1e3 * latency.token_gaps(outs).gaps)
    colors = {ax.lines[0].get_color() for ax in fig.axes}
    assert len(colors) == 3


def test_plot_tbt_cdf_lines_are_the_cdfs():
    runs = {"sarathi": fake_outputs(0), "prefill_first": fake_outputs(3)}
    ax = latency.plot_tbt_cdf(runs, tbt_slo=0.2, ymin=0.5)
    curves = [ln for ln in ax.lines if ln.get_label() in runs]
    assert [ln.get_label() for ln in curves] == list(runs)
    for ln, outs in zip(curves, runs.values(), strict=True):
        x, y = latency.ecdf(latency.token_gaps(outs).gaps)
        np.testing.assert_allclose(ln.get_xdata(), 1e3 * x)
        np.testing.assert_allclose(ln.get_ydata(), y)
    assert ax.get_xscale() == "log" and ax.get_ylim()[0] == 0.5
    slo = [ln for ln in ax.lines if ln.get_label().startswith("TBT SLO")]
    assert np.allclose(slo[0].get_xdata(), 200.0)


def test_plot_throughput_vs_budget():
    summaries = {b: summarize(fake_outputs(seed)) for seed, b in enumerate([256, 32, 64])}
    ax = latency.plot_throughput_vs_budget(summaries, tbt_slo=0.3)
    budgets = [32, 64, 256]
    np.testing.assert_array_equal(ax.lines[0].get_xdata(), budgets)
    np.testing.assert_allclose(
        ax.lines[0].get_ydata(), [summaries[b].total_token_throughput for b in budgets]
    )
    right = ax.figure.axes[-1]
    assert right is not ax
    np.testing.assert_allclose(
        right.lines[0].get_ydata(), [1e3 * summaries[b].tbt.p99 for b in budgets]
    )
    assert np.allclose(right.lines[1].get_ydata(), 300.0)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["throughput", "P99 TBT", "TBT SLO 300 ms"]


def test_plot_capacity_bars():
    caps = {
        "sarathi": CapacityResult(1.5, 0.2, []),
        "prefill_first": CapacityResult(0.25, 0.2, []),
        "decode_first": 0.75,
    }
    ax = latency.plot_capacity(caps)
    bars = ax.patches
    assert len(bars) == 3
    np.testing.assert_allclose([b.get_height() for b in bars], [1.5, 0.25, 0.75])
    assert [t.get_text() for t in ax.get_xticklabels()] == list(caps)
    assert [t.get_text() for t in ax.texts] == ["1.50", "0.25", "0.75"]
    assert "200 ms" in ax.get_title()
    assert bars[0].get_facecolor() != bars[1].get_facecolor()


def test_plot_throughput_vs_batch():
    rows = {
        "sarathi": [
            {"batch": 1, "output_tokens_per_s": 30.0},
            {"batch": 8, "output_tokens_per_s": 150.0},
        ],
        "prefill_first": [
            {"batch": 1, "output_tokens_per_s": 31.0},
            {"batch": 8, "output_tokens_per_s": 140.0},
        ],
    }
    ax = latency.plot_throughput_vs_batch(rows)
    assert [ln.get_label() for ln in ax.lines] == list(rows)
    np.testing.assert_array_equal(ax.lines[0].get_xdata(), [1, 8])
    np.testing.assert_array_equal(ax.lines[1].get_ydata(), [31.0, 140.0])


def test_plot_request_timeline():
    outs = fake_outputs()
    ax = latency.plot_request_timeline(outs)
    dots = [ln for ln in ax.lines if ln.get_marker() == "o"]
    assert len(dots) == len(outs) - 1  # the rejected request has no tokens
    start = min(o.metrics.arrival_time for o in outs)
    for ln, out in zip(dots, outs, strict=False):
        np.testing.assert_allclose(ln.get_xdata(), np.array(out.metrics.token_times) - start)
    delays = [p.get_width() for p in ax.patches]
    np.testing.assert_allclose(delays, [o.metrics.scheduling_delay for o in outs[:-1]])
    assert [t.get_text() for t in ax.texts] == ["rejected"]
    assert len(ax.get_yticklabels()) == len(outs)


def test_save_figure_writes_png(tmp_path):
    from llmjax.viz import save_figure

    path = save_figure(latency.plot_tbt_cdf({"sarathi": fake_outputs()}), str(tmp_path / "a.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
