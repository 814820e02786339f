"""scripts/rl_rollouts.py (issue 43): GRPO with llmjax as the rollout engine on the tiny model's
learnable task: the loss falls on a step's own batch after its optimizer step (10 of 12 steps
at least: Adam at this rate can overshoot once the KL term grows), the reward
rises over twelve steps, the KL to the start grows from 0, and the engine took each step's
weights (the weight version counts the updates)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_grpo_on_the_tiny_model_raises_the_reward(tmp_path):
    out, plot = tmp_path / "rl.json", tmp_path / "rl.png"
    args = ["--model", "tiny", "--load_format", "dummy", "--task", "target_tokens", "--steps",
            "12", "--learning_rate", "1e-2", "--out", str(out), "--plot", str(plot)]  # fmt: skip
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "rl_rollouts.py"), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    history = json.loads(out.read_text())["history"]
    assert [h["step"] for h in history] == list(range(12))
    lowered = sum(h["loss_after"] < h["loss"] for h in history)
    assert lowered >= 10, f"only {lowered} of 12 steps lowered the loss on their batch"
    reward = [h["reward"] for h in history]
    assert np.mean(reward[-4:]) > np.mean(reward[:4]) + 0.04, reward
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6) and history[-1]["kl"] > 0.01
    assert [h["weight_version"] for h in history] == list(range(2, 14))  # one per step
    assert "rollout" in run.stdout and plot.stat().st_size > 0
