"""GRPO (DeepSeekMath's group-relative policy optimization) with llmjax as the rollout engine
in the trainer's JAX process (issue 43; docs/rl.md): a verifiable task and its programmatic
reward, rollouts with their logprobs (`SamplingParams(n=..., logprobs=0)`), GRPO's advantages,
the clipped policy-gradient loss with a KL penalty to the starting policy on llmjax's functional
model, optax's Adam, and `LLM.update_weights` after every step. `scripts/rl_rollouts.py` and
colab/08_rl_rollouts.ipynb run it.

    config, policy = policy_weights("smollm2-135m-instruct")
    llm = LLM("smollm2-135m-instruct"); llm.update_weights(policy)
    history = train(llm, policy, config, "arithmetic", steps=20, ...)
"""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import numpy as np

TASKS = ("arithmetic", "target_tokens")
TARGET = 8  # target_tokens: ids that are multiples of this earn the reward


# ---- the task ----------------------------------------------------------------------------------


def make_prompts(task: str, rng: np.random.Generator, k: int, tokenizer, vocab_size: int):
    """k (prompt token ids, answer) pairs."""
    out = []
    for _ in range(k):
        if task == "target_tokens":
            out.append((rng.integers(3, vocab_size, 6).tolist(), TARGET))
            continue
        a, b = (int(x) for x in rng.integers(1, 50, 2))
        messages = [{"role": "user", "content": f"What is {a}+{b}? Reply with the number."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append((list(tokenizer.encode(text)), a + b))
    return out


def reward(task: str, token_ids: list[int], answer: int, tokenizer) -> float:
    if task == "target_tokens":
        return float(np.mean([t % answer == 0 for t in token_ids])) if token_ids else 0.0
    m = re.search(r"-?\d+", tokenizer.decode(token_ids))
    return float(m is not None and int(m.group()) == answer)


# ---- the loss ----------------------------------------------------------------------------------


class Batch(NamedTuple):
    """Sequences (prompt + completion) right-padded to one length; `mask` marks the completion
    tokens (the ones scored); `old_logp` their log probabilities when sampled; `adv` each
    sequence's advantage."""

    tokens: np.ndarray  # [B, N] int32
    mask: np.ndarray  # [B, N] float32 (position p: token p is a completion token)
    old_logp: np.ndarray  # [B, N] float32
    adv: np.ndarray  # [B] float32 (a pytree: jitted functions take it)


def token_logprobs(params, config, tokens):
    """log p(tokens[:, p] | tokens[:, :p]) for p >= 1, [B, N] (column 0 is 0): one prefill of
    every row through llmjax's model (jnp attention, so it differentiates)."""
    import jax
    import jax.numpy as jnp

    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.llama import forward
    from llmjax.model.step_input import contiguous_prefill

    B, N = tokens.shape
    page_size = 16
    step, _ = contiguous_prefill(np.zeros((B, N), np.int32), N, page_size)
    step = step._replace(token_ids=tokens.reshape(-1), logits_indices=np.arange(B * N))
    kv = allocate_kv_pages(config, 1 + B * -(-N // page_size), page_size, jnp.float32)
    logits, _ = forward(params, kv, step, config)
    logp = jax.nn.log_softmax(logits.reshape(B, N, -1)[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def grpo_loss(params, ref_params, batch: Batch, config, clip: float, beta: float):
    """GRPO's objective (negated): per completion token, min(r A, clip(r) A) with r the ratio to
    the sampling policy, minus beta times the k3 KL estimate to the reference policy; averaged
    over each sequence's tokens, then over the sequences. -> (loss, (kl, mean ratio))."""
    import jax
    import jax.numpy as jnp

    logp = token_logprobs(params, config, batch.tokens)
    ref = jax.lax.stop_gradient(token_logprobs(ref_params, config, batch.tokens))
    ratio = jnp.exp(logp - batch.old_logp)
    adv = batch.adv[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    kl = jnp.exp(ref - logp) - (ref - logp) - 1.0
    per_token = -(surrogate - beta * kl)
    count = jnp.maximum(batch.mask.sum(axis=1), 1.0)
    seq = lambda x: ((x * batch.mask).sum(axis=1) / count).mean()
    return seq(per_token), (seq(kl), seq(ratio))


# ---- the loop ----------------------------------------------------------------------------------


def rollouts(llm, prompts, group_size: int, max_tokens: int, seed: int, ignore_eos=False):
    """Each prompt's `group_size` samples from the engine: [[(token ids, logprobs)]]."""
    from llmjax import SamplingParams

    params = SamplingParams(n=group_size, temperature=1.0, max_tokens=max_tokens, logprobs=0,
                            seed=seed, ignore_eos=ignore_eos)  # fmt: skip
    outs = llm.generate([p for p, _ in prompts], params)
    groups = []
    for out in outs:
        samples = []
        for c in out.outputs:
            lps = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)]
            samples.append((list(c.token_ids), lps))
        groups.append(samples)
    return groups


def make_batch(prompts, groups, rewards, length: int) -> Batch:
    rows, masks, olds, advs = [], [], [], []
    for (prompt, _), samples, rs in zip(prompts, groups, rewards, strict=True):
        rs = np.asarray(rs, np.float32)
        adv = (rs - rs.mean()) / (rs.std() + 1e-4)  # GRPO: normalized within the group
        for (ids, lps), a in zip(samples, adv, strict=True):
            seq = prompt + ids
            row, mask, old = (np.zeros(length, t) for t in (np.int32, np.float32, np.float32))
            row[: len(seq)] = seq
            mask[len(prompt) : len(seq)] = 1.0
            old[len(prompt) : len(seq)] = lps
            rows.append(row), masks.append(mask), olds.append(old), advs.append(a)
    return Batch(*(np.stack(x) for x in (rows, masks, olds)), np.asarray(advs, np.float32))


def train(llm, policy, config, task: str, steps: int, prompts_per_step: int, group_size: int,
          max_tokens: int, learning_rate: float, beta: float, clip: float, seed: int,
          log=print) -> list[dict]:  # fmt: skip
    """`steps` GRPO steps of `policy` (llmjax's float32 pytree, the list layout; `llm` serves
    it); returns the per-step history."""
    import jax
    import optax

    tokenizer = llm.tokenizer
    rng = np.random.default_rng(seed)
    ref = jax.tree.map(lambda x: x, policy)  # the starting policy (the KL's reference)
    opt = optax.adam(learning_rate)
    state = opt.init(policy)
    loss_fn = lambda p, b: grpo_loss(p, ref, b, config, clip, beta)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    eval_fn = jax.jit(loss_fn)
    apply = jax.jit(lambda p, s, g: _apply(opt, p, s, g))
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        prompts = make_prompts(task, rng, prompts_per_step, tokenizer, config.vocab_size)
        groups = rollouts(llm, prompts, group_size, max_tokens, seed * 1000 + step,
                          ignore_eos=task == "target_tokens")  # fmt: skip
        rewards = [[reward(task, ids, ans, tokenizer) for ids, _ in g]
                   for (_, ans), g in zip(prompts, groups, strict=True)]  # fmt: skip
        length = max(len(p) for p, _ in prompts) + max_tokens
        batch = make_batch(prompts, groups, rewards, -(-length // 16) * 16)
        t1 = time.perf_counter()
        (loss, (kl, ratio)), grads = grad_fn(policy, batch)
        policy, state = apply(policy, state, grads)
        after, _ = eval_fn(policy, batch)
        jax.block_until_ready(after)
        t2 = time.perf_counter()
        version = llm.update_weights(policy)
        t3 = time.perf_counter()
        row = dict(step=step, reward=float(np.mean(rewards)), kl=float(kl), loss=float(loss),
                   loss_after=float(after), ratio=float(ratio), weight_version=version,
                   rollout_s=t1 - t0, gradient_s=t2 - t1, update_s=t3 - t2)  # fmt: skip
        history.append(row)
        log(
            f"{step:4d} {row['reward']:7.3f} {row['kl']:8.4f} {row['loss']:9.4f} "
            f"{row['loss_after']:9.4f} {row['rollout_s']:8.2f} {row['gradient_s']:8.2f} "
            f"{row['update_s']:7.2f}"
        )
    return history


def _apply(opt, params, state, grads):
    import optax

    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def policy_weights(model: str, load_format: str):
    """The trainer's copy: (ModelConfig, float32 weights as jax arrays, the list layout)."""
    import jax.numpy as jnp

    from llmjax.loading import load

    config, params, _ = load(model, "float32", load_format, None)
    return config, {k: _as_jnp(v, jnp) for k, v in params.items()}


def _as_jnp(v, jnp):
    if isinstance(v, list):
        return [{k: jnp.asarray(x, jnp.float32) for k, x in layer.items()} for layer in v]
    return jnp.asarray(v, jnp.float32)
