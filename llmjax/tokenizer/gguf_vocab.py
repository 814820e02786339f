"""Rebuilds a Hugging Face `tokenizers` backend from a GGUF file's tokenizer metadata.

A GGUF has no `tokenizer.json`: it stores the vocabulary, the merges and the token types under
llama.cpp's key names, and we rebuild the tokenizer they describe the way llama.cpp and
transformers' GGUF loader do:

  tokenizer.ggml.model  'gpt2'   byte-level BPE; the pre-tokenizer split is chosen by
                                 tokenizer.ggml.pre (see `_PRE_TOKENIZER_SPLITS`).
                        'llama'  sentencepiece-style BPE with byte fallback (Llama 2, Mistral);
                                 merges are taken from the file or rebuilt from token scores.

`Tokenizer.from_gguf` puts these pieces together. No jax here.
"""

from __future__ import annotations

import functools
import os
import warnings

import gguf
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

# llama.cpp's token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# The GPT-2 split, which `pre_tokenizers.ByteLevel(use_regex=True)` applies by itself.
_GPT2_NAMES = ("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2", "roberta-bpe", "jina-v1-en")
# llama.cpp splits every digit off first for these (their tokenizer.json has `Digits`).
_DIGIT_NAMES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex its merges were learned under (applied before byte-level BPE).
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("smaug-bpe", "lfm2"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# Sentencepiece files whose architecture needs more than the plain 'llama' recipe.
_UNSUPPORTED_SPM_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "phi3")


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _read_gguf_tokenizer_metadata(source: str | os.PathLike | gguf.GGUFReader) -> tuple[str, dict]:
    """`(file name, {key: value})` for general.architecture and every tokenizer.* key."""
    from llmjax.checkpoint.gguf_file import gguf_file_name, open_gguf

    if isinstance(source, gguf.GGUFReader):
        reader = source
        name = gguf_file_name(source, "<GGUFReader>")
    else:
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise FileNotFoundError(f"GGUF file not found: {name!r}")
        reader = open_gguf(name)
    metadata = {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in metadata]
    if missing:
        raise ValueError(f"GGUF file {name!r} has no tokenizer metadata (missing {missing})")
    return name, metadata


def _byte_level_backend(meta: dict) -> BackendTokenizer:
    """Byte-level BPE (GPT-2 family): every token is spelled in the 256-character byte alphabet."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(meta["tokenizer.ggml.tokens"])
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(
        BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="")
    )
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre in _PRE_TOKENIZER_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_NAMES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        if pre not in _GPT2_NAMES:
            warnings.warn(
                f"Unknown tokenizer.ggml.pre={pre!r}; splitting text with the GPT-2 regex, as "
                "transformers does. Encodings may differ from llama.cpp's.",
                stacklevel=3,
            )
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Sentencepiece merges implied by the vocabulary: split each token into two tokens, and rank
    the pairs by the merged token's score (best first), as transformers' `generate_merges` does."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for merged, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [(merged[:k], merged[k:], score) for k in range(1, len(merged))]
        pairs = [p for p in pairs if p[0] in vocab and p[1] in vocab]
        merges += sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(meta: dict, name: str) -> BackendTokenizer:
    """Sentencepiece-style BPE (Llama 2, Mistral): '▁' marks a space, unknown bytes fall back to
    <0xNN> tokens, and a space is put in front of the text when tokenizer.ggml.add_space_prefix."""
    tokens = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        if "tokenizer.ggml.scores" not in meta:
            raise ValueError(f"GGUF file {name!r} has neither tokenizer.ggml.merges nor .scores")
        merges = _merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = BackendTokenizer(BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
    add_prefix_space = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _special_token(meta: dict, key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and token_id < len(tokens) else None


def _template_processor(
    bos: str | None, eos: str | None, vocab: dict[str, int]
) -> processors.TemplateProcessing:
    """`[bos] text [eos]`, with either end optional."""
    head, tail = ([f"{bos}:0"] if bos else []), ([f"{eos}:0"] if eos else [])
    tail_b = [f"{eos}:1"] if eos else []
    head_b = [f"{bos}:1"] if bos else []
    return processors.TemplateProcessing(
        single=[*head, "$A:0", *tail],
        pair=[*head, "$A:0", *tail, *head_b, "$B:1", *tail_b],
        special_tokens=[(t, vocab[t]) for t in {bos, eos} if t and t in vocab],
    )


def _add_gguf_special_tokens(backend, meta, named_specials, *, byte_level: bool) -> None:
    """Registers the file's CONTROL tokens (and the named BOS/EOS/UNK/PAD) as special tokens and
    its USER_DEFINED ones as plain added tokens, so both are matched whole in the text.

    In a byte-level vocabulary a CONTROL token using characters outside the byte alphabet is a
    llama.cpp mislabel; it is skipped, as transformers does.
    """
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [
        tok
        for tok, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    # Never add a new id: only named specials that the vocabulary already has.
    named = [t for t in named_specials if t is not None and backend.token_to_id(t) is not None]
    control += [t for t in named if t not in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = backend.get_vocab()
    user = [tok for tok, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user if t in vocab])
