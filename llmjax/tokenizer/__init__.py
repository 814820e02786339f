"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

  tokenizer.py    `Tokenizer`: wraps a Hugging Face `tokenizers.Tokenizer` built from a GGUF file
                  or a model directory's `tokenizer.json`; encodes, decodes, renders chat templates.
  gguf_vocab.py   rebuilds the `tokenizers` backend that a GGUF file's metadata describes.
  detokenizer.py  `IncrementalDetokenizer`: generated ids -> printable text pieces, as they come;
                  `StopStringMatcher`: the first stop string in the growing text;
                  `TextStream`: a request's outputs -> text pieces that join to its final text.

No jax here: the engine's host side uses this package.
"""

from llmjax.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream
from llmjax.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "TextStream", "Tokenizer"]
