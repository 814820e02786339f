"""What the applications share: output lengths and stopping (`AppParams`) and the input text."""

from __future__ import annotations

import dataclasses

from llmjax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class AppParams:
    """How the applications' outputs are generated.

    output_tokens: the longest output (summaries, plans, reports); `short_tokens` for the short
        ones (a review's verdict). exact: every output is exactly that long (ignore_eos, no stop
        strings): the simulator's setting and a benchmark's, so runs compare like for like;
        else outputs stop at EOS as the model decides. temperature 0 (greedy) unless given."""

    output_tokens: int = 48
    short_tokens: int = 24
    exact: bool = False
    temperature: float = 0.0

    def sampling(self, short: bool = False) -> SamplingParams:
        n = self.short_tokens if short else self.output_tokens
        return SamplingParams(max_tokens=n, ignore_eos=self.exact, temperature=self.temperature)


def document_chunks(tokenizer, num_chunks: int, chunk_tokens: int, offset: int = 0) -> list[str]:
    """`num_chunks` consecutive windows of about `chunk_tokens` tokens of the bundled
    public-domain text (llmjax/data/), from token `offset`, as text; the text repeats if
    more is asked for than it has."""
    from llmjax.data.texts import public_domain_text

    if num_chunks < 1 or chunk_tokens < 1:
        raise ValueError(f"{num_chunks=} and {chunk_tokens=} must be >= 1")
    ids = tokenizer.encode(public_domain_text(), add_special_tokens=False)
    need = offset + num_chunks * chunk_tokens
    ids = ids * (-(-need // len(ids)))
    return [
        tokenizer.decode(ids[offset + i * chunk_tokens : offset + (i + 1) * chunk_tokens]).strip()
        for i in range(num_chunks)
    ]


DEFAULT = AppParams()
