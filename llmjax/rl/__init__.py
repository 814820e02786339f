"""llmjax as the rollout engine of an RL loop (issue 43; docs/rl.md): `grpo` is a small GRPO
trainer over `LLM.update_weights` (optax: the `rl` extra)."""
