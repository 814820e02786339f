"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust one) built either from a GGUF
file's metadata or from a model directory's `tokenizer.json`. A GGUF has no `tokenizer.json`: it
stores the vocabulary, the merges and the token types under llama.cpp's key names, and we rebuild
the tokenizer they describe the way llama.cpp and transformers' GGUF loader do:

  tokenizer.ggml.model  'gpt2'   byte-level BPE; the pre-tokenizer split is chosen by
                                 tokenizer.ggml.pre (see `_PRE_TOKENIZER_SPLITS`).
                        'llama'  sentencepiece-style BPE with byte fallback (Llama 2, Mistral);
                                 merges are taken from the file or rebuilt from token scores.

`IncrementalDetokenizer` turns a stream of generated ids into printable text pieces. No jax here:
the engine's host side uses this module.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import gguf
import jinja2
import jinja2.sandbox
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
# Generated tokens decoded together with the last few prompt tokens, so a leading space survives.
_PROMPT_CONTEXT_LEN = 6


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
    if isinstance(source, gguf.GGUFReader):
        reader = source
        name = str(getattr(source.data, "filename", None) or "<GGUFReader>")
    else:
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise FileNotFoundError(f"GGUF file not found: {name!r}")
        reader = gguf.GGUFReader(name)
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


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


@functools.cache
def _compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed jinja2 template with the helpers Hugging Face chat templates rely on."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encodes text to token ids and back, and renders the model's chat template.

    Build one with `Tokenizer.from_gguf(path)` or `Tokenizer.from_hf_dir(path)`.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ):
        self._backend = backend
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        self._special |= {"unk_token": unk_token, "pad_token": pad_token}
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | gguf.GGUFReader) -> Tokenizer:
        """The tokenizer a GGUF file describes (a path, or an already opened `gguf.GGUFReader`)."""
        name, meta = _read_gguf_tokenizer_metadata(source)
        model = meta["tokenizer.ggml.model"]
        architecture = meta.get("general.architecture")
        if model == "gpt2":
            backend = _byte_level_backend(meta)
            add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
        elif model == "llama" and architecture not in _UNSUPPORTED_SPM_ARCHITECTURES:
            backend = _sentencepiece_backend(meta, name)
            # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
            add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
        else:
            raise NotImplementedError(
                f"tokenizer.ggml.model={model!r} with general.architecture={architecture!r} in "
                f"{name!r} is not supported; supported models: 'gpt2' (byte-level BPE) and 'llama' "
                f"(sentencepiece BPE, except architectures {_UNSUPPORTED_SPM_ARCHITECTURES})"
            )
        special = {
            "bos_token": _special_token(meta, "bos_token_id"),
            "eos_token": _special_token(meta, "eos_token_id"),
            "unk_token": _special_token(meta, "unknown_token_id"),
            "pad_token": _special_token(meta, "padding_token_id"),
        }
        _add_gguf_special_tokens(backend, meta, special.values(), byte_level=model == "gpt2")
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        vocab = backend.get_vocab()
        backend.post_processor = _template_processor(
            special["bos_token"] if add_bos else None,
            special["eos_token"] if add_eos else None,
            vocab,
        )
        return cls(
            backend,
            **special,
            add_bos_token=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer in a Hugging Face model directory (`tokenizer.json` and
        `tokenizer_config.json`; the chat template may also be in `chat_template.jinja`)."""
        files = {n: os.path.join(path, n) for n in ("tokenizer.json", "tokenizer_config.json")}
        for file in files.values():
            if not os.path.isfile(file):
                raise FileNotFoundError(f"Tokenizer file not found: {file!r}")
        backend = BackendTokenizer.from_file(files["tokenizer.json"])
        with open(files["tokenizer_config.json"], encoding="utf-8") as f:
            config = json.load(f)
        special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token")}
        special |= {k: _token_content(config.get(k)) for k in ("unk_token", "pad_token")}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: take the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if "add_bos_token" in config or "add_eos_token" in config:
            # An explicit flag overrides tokenizer.json's post-processor, as in transformers.
            bos = special["bos_token"] if config.get("add_bos_token") else None
            eos = special["eos_token"] if config.get("add_eos_token") else None
            backend.post_processor = _template_processor(bos, eos, backend.get_vocab())
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and probe[:1] == [bos_id]
        return cls(backend, **special, add_bos_token=add_bos, chat_template=template)

    # ---- ids <-> text -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS goes first if the model asks for it.
        Special tokens written in the text (e.g. "<|im_start|>") are always matched whole."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Renders `messages` ([{"role": ..., "content": ...}]) with the model's jinja2 template.

        Returns the prompt string, or its ids when `tokenize` (encoded without adding BOS: the
        template writes any special tokens itself). Extra keyword arguments (e.g. `tools`) are
        passed to the template.
        """
        if not self.chat_template:
            raise ValueError("This tokenizer has no chat_template; pass a plain prompt instead")
        # As in transformers: `tools`, `documents` and the special tokens are always defined.
        variables = {"tools": None, "documents": None}
        variables |= {k: v for k, v in self._special.items() if v is not None}
        text = _compile_chat_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **(variables | template_kwargs),
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def id_to_token(self, token_id: int) -> str | None:
        """The token's spelling in the vocabulary (byte-level or '▁' form), None if out of range."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (spelled as in `id_to_token`), None if absent."""
        return self._backend.token_to_id(token)

    # ---- properties ------------------------------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _special_id(self, name: str) -> int | None:
        token = self._special[name]
        return self._backend.token_to_id(token) if token is not None else None

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (dropped by `decode(..., skip_special_tokens=True)`)."""
        added = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of sentencepiece byte tokens (<0x00>..<0xFF>) when the model falls back to them.

        The byte-fallback decoder turns a whole run of them into text at once, and into one U+FFFD
        per byte if the run is not valid UTF-8, so a later byte can change how earlier ones read.
        """
        model = self._backend.model
        if not (isinstance(model, BPE) and model.byte_fallback):
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_id={self.eos_token_id}, add_bos_token={self.add_bos_token})"
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


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into newly printable text.

    Text is decoded over a small window of recent ids and held back while it ends in U+FFFD (a
    UTF-8 character split across byte-level tokens) or in a run of sentencepiece byte tokens
    (<0xNN>), so no piece ends in a partial character. The pieces from `add`, followed by
    `finish()`, concatenate to `tokenizer.decode(generated_ids)`. With
    `prompt_ids`, the last few prompt tokens are decoded along with the first generated ones, so
    decoders that strip a leading space (sentencepiece) keep the space a continuation starts with.

        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        for token_id in generated: print(detok.add(token_id), end="")
        print(detok.finish())
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or [])[-_PROMPT_CONTEXT_LEN:]
        if self._decode(context).endswith("\ufffd"):
            context = []  # a prompt ending mid-character: decode the continuation on its own
        self._ids = context  # the window: ids[:_read] were already turned into text
        self._read = len(context)
        self._read_text = self._decode(context)
        self.token_ids: list[int] = []
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _emit(self, text: str) -> str:
        if text.startswith(self._read_text):
            piece = text[len(self._read_text) :]
        else:  # not seen with byte-level or sentencepiece decoders; keep going without crashing
            pairs = zip(text, self._read_text, strict=False)
            same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(self._read_text))
            piece = text[same:]
        # Slide the window: the ids just read become the context for the next ones.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._read_text = self._decode(self._ids)
        self.text += piece
        return piece

    def add(self, token_id: int) -> str:
        """Appends one generated id; returns the text it completes ('' while a character is split
        across tokens, or for a skipped special token)."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        if self._in_byte_run():
            return ""
        text = self._decode(self._ids)
        if len(text) > len(self._read_text) and not text.endswith("\ufffd"):
            return self._emit(text)
        return ""

    def _in_byte_run(self) -> bool:
        """Whether the last id that decodes to text is a byte-fallback token."""
        byte_ids = self._tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        skipped = self._tokenizer.special_ids if self._skip else frozenset()
        last = next((i for i in reversed(self._ids) if i not in skipped), None)
        return last in byte_ids

    def finish(self) -> str:
        """Returns the held-back text (e.g. a trailing incomplete character, as U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        return self._emit(self._decode(self._ids))
