"""scripts/placement.py: DistServe's placement search and its comparison, on the simulator."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def placement():
    """The script as a module (its flags are defined only when it runs as a script)."""
    spec = importlib.util.spec_from_file_location(
        "placement_script", os.path.join(ROOT, "scripts", "placement.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _setup(placement, **changes):
    from configs import PRESETS
    from llmjax.sim import get_hardware

    base = dict(
        model=PRESETS["opt-13b"],
        hardware=get_hardware("a100-80gb"),
        max_model_len=2048,
        max_num_seqs=256,
        prefill_max_tokens=2048,
        memory_utilization=0.9,
        workload="sharegpt",
        scale=1.0,
        num_requests=20,
        seed=0,
        ttft_slo=0.25,
        tpot_slo=0.1,
        attainment=0.9,
        max_rate=5.0,
        esp=0.25,
    )
    return placement.Setup(**(base | changes))


def test_the_phase_bisection_is_monotone_and_within_esp(placement):
    """A fake phase whose attainment drops past a threshold per-device rate: the goodput found
    is within esp below it, grows with it, and every trial at or below it passed."""
    s = _setup(placement)
    found = []
    for threshold in (0.3, 0.9, 1.7, 2.6, 3.1, 4.4):
        for devices in (1, 2, 4):
            seen = []

            def run(qps, threshold=threshold, devices=devices, seen=seen):
                seen.append(qps)
                rate = qps / devices  # the search runs the deployment's total rate
                return types.SimpleNamespace(slo_attainment=0.95 if rate <= threshold else 0.5)

            r = placement.phase_goodput(run, devices, s)
            assert threshold - s.esp < r.goodput_per_device <= threshold, (threshold, r)
            assert r.num_devices == devices and r.goodput == r.goodput_per_device * devices
            assert all(ok == (q / devices <= threshold) for q, _, ok in r.trials)
            assert len(seen) == len(r.trials) <= 6
            found.append(r.goodput_per_device)
    per_threshold = [max(found[k : k + 3]) for k in range(0, len(found), 3)]
    assert per_threshold == sorted(per_threshold)


def test_choose_takes_the_best_per_device_and_replicates_to_the_target(placement):
    def row(phase, tp, pp, g, capped=False):
        return dict(phase=phase, tp=tp, pp=pp, num_devices=tp * pp, goodput_per_device=g,
                    goodput_per_instance=g * tp * pp, capped=capped)  # fmt: skip

    rows = [
        row("prefill", 1, 1, 1.2), row("prefill", 2, 1, 1.8), row("prefill", 4, 1, 1.8),
        row("decode", 1, 1, 2.0), row("decode", 1, 2, 1.5),
    ]  # fmt: skip
    c = placement.choose(rows, target_rate=10.0)
    assert (c["prefill"]["tp"], c["prefill"]["pp"]) == (2, 1)  # a tie: fewer devices
    assert (c["decode"]["tp"], c["decode"]["pp"]) == (1, 1)
    assert (c["n_prefill"], c["n_decode"]) == (3, 5)  # ceil(10 / 3.6), ceil(10 / 2.0)
    assert c["num_devices"] == 3 * 2 + 5 * 1
    assert c["estimated_goodput"] == pytest.approx(10.0)
    assert placement.choose(rows, target_rate=2.0)["n_decode"] == 1
    with pytest.raises(ValueError, match="no decode"):
        placement.choose(rows[:3], target_rate=1.0)
    with pytest.raises(ValueError, match="meets its SLO"):
        placement.choose([*rows[:3], row("decode", 1, 1, 0.0)], target_rate=1.0)


def test_what_fits_on_the_device(placement):
    from configs import PRESETS

    s = _setup(placement)
    assert placement.fits(s, 1, 1) > placement.fits(s, 1, 1) // 2 > 0
    assert placement.fits(s, 2, 1) > 2 * placement.fits(s, 1, 1)  # weights split: more KV
    assert placement.fits(s, 3, 1) is None  # 3 does not divide OPT-13B's 40 heads
    big = _setup(placement, model=PRESETS["opt-175b"])
    assert placement.fits(big, 1, 1) is None and placement.fits(big, 8, 1) > 0


def test_one_phase_each_on_the_simulator(placement):
    """The prefill phase ends every request at its first token; the decode phase's requests get
    their first token at arrival (the ideal prefill) and decode on the decode instance."""
    s = _setup(placement, num_requests=12)
    pre = placement.run_prefill_phase(s, 2, 1, qps=2.0)
    assert pre.num_finished == 12 and pre.tpot.max == 0.0 and pre.ttft.p50 > 0.01
    dec = placement.run_decode_phase(s, 1, 1, qps=2.0)
    assert dec.num_finished == 12 and dec.ttft.max == 0.0 and 0.01 < dec.tpot.p50 < 0.1
    assert pre.slo_attainment is not None and dec.slo_attainment is not None


def test_the_script_runs_end_to_end_and_writes_the_choice(tmp_path):
    out = tmp_path / "placement.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "scripts", "placement.py"), "--quick", "--compare",
        "--num_requests=24", "--max_rate=2", "--esp=0.5", "--tps=1,2", "--pps=1",
        "--sarathi_budgets=512", "--target_rate=2", "--compare_seeds=0,1",
        "--curve_rates=0.5,1", "--slo_scales=0.5,2", "--scale=0.25", f"--output_json={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    assert "choice (simulated)" in proc.stdout and "7.4x" in proc.stdout
    assert "colocated prefill_first (vLLM)" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["simulated"] is True and doc["settings"]["num_requests"] == 24
    rows = doc["candidates"]
    assert {(r["phase"], r["tp"], r["pp"]) for r in rows} == {
        ("prefill", 1, 1), ("prefill", 2, 1), ("decode", 1, 1), ("decode", 2, 1)
    }  # fmt: skip
    assert all(r["trials"] and 0 <= r["goodput_per_device"] <= 2 for r in rows)
    choice = doc["choice"]
    for phase in ("prefill", "decode"):
        assert choice[phase]["tp"] in (1, 2) and choice[phase]["pp"] == 1
    assert choice["n_prefill"] >= 1 and choice["n_decode"] >= 1
    assert choice["num_devices"] == (
        choice["n_prefill"] * choice["prefill"]["num_devices"]
        + choice["n_decode"] * choice["decode"]["num_devices"]
    )
    cmp = doc["comparison"]
    assert set(cmp) == {"disaggregated", "disaggregated/paper", "prefill_first", "sarathi/512"}
    paper = cmp["disaggregated/paper"]["placement"]  # ALGORITHMS.md §7.3's OPT-13B placement
    assert (paper["prefill"]["tp"], paper["decode"]["tp"]) == (2, 1) == (
        doc["paper_placement"]["prefill"]["tp"], doc["paper_placement"]["decode"]["tp"]
    )  # fmt: skip
    assert cmp["disaggregated"]["num_devices"] == choice["num_devices"]
    assert all(v["trials"] for v in cmp.values())
    assert set(doc["ratios_vs_vllm"]) == set(cmp)
    for v in cmp.values():  # two seeds: their mean, and each seed's
        per_seed = v["goodput_per_device_per_seed"]
        assert len(per_seed) == 2 and abs(v["goodput_per_device"] - sum(per_seed) / 2) < 1e-9
        by_rate = [c["per_device_rate"] for c in v["curves"]["by_rate"]]
        assert by_rate == [0.5, 1.0]
        (loose,) = [c["attainment"] for c in v["curves"]["by_slo_scale"] if c["slo_scale"] == 2]
        (tight,) = [c["attainment"] for c in v["curves"]["by_slo_scale"] if c["slo_scale"] == 0.5]
        assert tight <= loose  # looser SLOs are met at least as often
    assert "SLO attainment vs SLO scale" in proc.stdout


def test_a_minimum_trial_length_adds_requests_at_high_rates(placement):
    s = _setup(placement, num_requests=20, min_trial_s=10.0)
    assert len(placement.specs_at(s, 1.0)) == 20
    long = placement.specs_at(s, 5.0)
    assert len(long) == 50 and long[-1].arrival_time > 5.0
    assert len(placement.specs_at(_setup(placement, num_requests=20), 5.0)) == 20
