"""Progress bars (llmjax/progress.py): LLM.generate(use_tqdm=True) shows one; elsewhere they show
only on a terminal."""

from llmjax import LLM, SamplingParams
from llmjax.progress import progress_bar


def test_generate_with_tqdm_reports_every_request(capsys):
    llm = LLM("tiny", load_format="dummy", max_model_len=32, num_pages=16)
    outs = llm.generate([[5, 6, 7], [8, 9], [10]], SamplingParams(max_tokens=3), use_tqdm=True)
    assert len(outs) == 3 and all(o.finished for o in outs)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output" in err and "tok/s" in err


def test_bars_off_the_terminal_stay_quiet(capsys):
    bar = progress_bar(4, "precompile", unit="shape")  # stderr is not a terminal under pytest
    for _ in range(4):
        bar.update(1)
    bar.close()
    assert "precompile" not in capsys.readouterr().err
    shown = progress_bar(2, "asked for", show=True)
    shown.update(2)
    shown.close()
    assert "asked for" in capsys.readouterr().err
