"""`Tokenizer`: text <-> token ids, and the model's chat template.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust one) built either from a GGUF
file's metadata (rebuilt in `gguf_vocab`) or from a model directory's `tokenizer.json`. No jax
here: the engine's host side uses this module.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import gguf
import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from llmjax.tokenizer.gguf_vocab import (
    _UNSUPPORTED_SPM_ARCHITECTURES,
    _add_gguf_special_tokens,
    _byte_level_backend,
    _read_gguf_tokenizer_metadata,
    _sentencepiece_backend,
    _special_token,
    _template_processor,
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
