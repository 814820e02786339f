"""Progress bars (tqdm) for long host loops: `LLM.generate(use_tqdm=True)`, precompiling the step
shapes, benchmark replays and the serving load generator. Written to stderr; `show=None` shows
the bar only on a terminal (tqdm's `disable=None`), so logs and CI output stay clean."""

from __future__ import annotations


def progress_bar(total: int, desc: str, unit: str = "it", show: bool | None = None):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        disable=None if show is None else not show,
    )
