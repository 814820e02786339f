"""GRPO with llmjax as the rollout engine, in one JAX process (issue 43; docs/rl.md).

The loop is `llmjax.rl.grpo.train`; this script runs it with flags. Each step: a batch of
prompts of a verifiable task, `--group_size` samples of each from the engine
(`SamplingParams(n=..., logprobs=0)`: the sampled tokens' log probabilities), a programmatic
reward, GRPO's group-normalized advantages, the clipped policy-gradient loss with a KL penalty
to the starting policy (the k3 estimator) on the trainer's float32 copy of the weights
(llmjax's functional model, `jax.value_and_grad`, optax's Adam), and the new weights pushed
into the engine with `LLM.update_weights` (no recompile, the prefix cache restarted).

Tasks:
  arithmetic     "What is 23+45? Reply with the number." -> 1 if the first number in the reply
                 is the sum (SmolLM2-135M-Instruct solves some of them to start with)
  target_tokens  reward = the fraction of sampled tokens whose id is a multiple of 8 (an
                 eighth of them to start with: learnable by a random model, the test's task on
                 the tiny preset)

    python scripts/rl_rollouts.py                                  # SmolLM2, arithmetic
    python scripts/rl_rollouts.py --model tiny --load_format dummy --task target_tokens \\
        --steps 8 --out /tmp/rl.json --plot /tmp/rl.png

Prints a row per step (reward, KL, the policy loss before and after the step on the same batch,
seconds in rollout / gradient / update) and writes them as JSON (and a plot of reward and KL).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmjax.rl.grpo import TASKS, policy_weights, train

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "A preset or checkpoint path.")
flags.DEFINE_enum("load_format", "auto", ["auto", "dummy"], "'dummy': random weights.")
flags.DEFINE_enum("task", "arithmetic", list(TASKS), "The verifiable task.")
flags.DEFINE_integer("steps", 20, "GRPO steps.")
flags.DEFINE_integer("prompts_per_step", 4, "Prompts per step.")
flags.DEFINE_integer("group_size", 8, "Samples per prompt (GRPO's group; SamplingParams.n).")
flags.DEFINE_integer("max_tokens", 8, "Tokens sampled per completion.")
flags.DEFINE_float("learning_rate", 2e-5, "Adam's learning rate.")
flags.DEFINE_float("beta", 0.04, "The KL penalty's weight (to the starting policy).")
flags.DEFINE_float("clip", 0.2, "PPO's ratio clip.")
flags.DEFINE_integer("seed", 0, "Prompts and sampling seed.")
flags.DEFINE_string("out", None, "Write the per-step history here (JSON).")
flags.DEFINE_string("plot", None, "Plot reward and KL over the steps here (PNG).")


def main(argv):
    del argv
    from llmjax import LLM

    config, policy = policy_weights(FLAGS.model, FLAGS.load_format)
    B = FLAGS.prompts_per_step * FLAGS.group_size
    llm = LLM(FLAGS.model, load_format=FLAGS.load_format, max_num_seqs=max(B, 8),
              max_model_len=256, compilation_cache_dir="")  # fmt: skip
    llm.update_weights(policy)  # the engine serves the trainer's copy from the start
    if FLAGS.task == "arithmetic" and llm.tokenizer is None:
        sys.exit("the arithmetic task needs a tokenizer: a real model, or --task target_tokens")
    print(f"GRPO on {FLAGS.model} ({FLAGS.task}): {FLAGS.steps} steps of {FLAGS.prompts_per_step}"
          f" prompts x {FLAGS.group_size} samples, {FLAGS.max_tokens} tokens each")  # fmt: skip
    print(f"{'step':>4} {'reward':>7} {'KL':>8} {'loss':>9} {'after':>9} {'rollout':>8} "
          f"{'grad':>8} {'update':>7}  (seconds)")  # fmt: skip
    history = train(llm, policy, config, FLAGS.task, FLAGS.steps, FLAGS.prompts_per_step,
                    FLAGS.group_size, FLAGS.max_tokens, FLAGS.learning_rate, FLAGS.beta,
                    FLAGS.clip, FLAGS.seed)  # fmt: skip
    steps = history[1:] or history  # (the first step compiles)
    mean = lambda k: float(np.mean([h[k] for h in steps]))
    print(f"per step (after the first): rollout {mean('rollout_s'):.2f} s, gradient "
          f"{mean('gradient_s'):.2f} s, update_weights {mean('update_s'):.2f} s")  # fmt: skip
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in ("model", "task", "steps",
                      "prompts_per_step", "group_size", "max_tokens", "learning_rate", "beta")},
                      history=history), f, indent=1)  # fmt: skip
    if FLAGS.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
        x = [h["step"] for h in history]
        a.plot(x, [h["reward"] for h in history]), a.set_title("mean reward"), a.set_xlabel("step")
        b.plot(x, [h["kl"] for h in history]), b.set_title("KL to the start"), b.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(FLAGS.plot, dpi=120)


if __name__ == "__main__":
    app.run(main)
