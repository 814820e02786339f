"""Public-domain English prose shipped with llmjax, for perplexity evaluation and calibration.

The texts are stored beside this module in `llmjax/data/` (see its README.md for provenance).
They stand in for PG-19 (Project Gutenberg books), which InfiniGen uses to calibrate its
skewing matrices, so the sparse-attention code in `llmjax/sparse/` can be evaluated and
calibrated offline.
"""

from importlib import resources

AVAILABLE_TEXTS: tuple[str, ...] = ("alice",)
"""Names accepted by `public_domain_text`."""


def public_domain_text(name: str = "alice") -> str:
    """Return a bundled public-domain English text as one string.

    Args:
        name: which text to load; one of `AVAILABLE_TEXTS`. "alice" is Chapters I-V of Lewis
            Carroll's *Alice's Adventures in Wonderland* (1865, Project Gutenberg etext #11,
            without the Gutenberg header/footer), about 60,000 characters.

    Returns:
        The text, decoded as UTF-8, with `\\n` line endings.

    Raises:
        ValueError: if `name` is not in `AVAILABLE_TEXTS`.
    """
    if name not in AVAILABLE_TEXTS:
        raise ValueError(
            f"unknown public-domain text {name!r}; available: {', '.join(AVAILABLE_TEXTS)}"
        )
    return resources.files("llmjax.data").joinpath(f"{name}.txt").read_text(encoding="utf-8")


def text_token_ids(tokenizer, vocab_size: int, name: str = "alice") -> list[int]:
    """A bundled text (`public_domain_text(name)`) as token ids: `tokenizer.encode`, or without a
    tokenizer (random weights) its UTF-8 bytes folded into the vocabulary (byte % vocab_size)."""
    text = public_domain_text(name)
    if tokenizer is not None:
        return list(tokenizer.encode(text))
    return [b % vocab_size for b in text.encode()]
