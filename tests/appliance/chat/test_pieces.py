"""The fast path of encoding: the library's ids for plain ASCII text, for every pipeline it
accepts; None (the library's turn) for any other text; no fast path for a pipeline it does not
read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from appliance.chat import pieces
from appliance.chat.pieces import PieceEncoder
from appliance.chat.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello, world! It's 2024 and they'll say we've done it; I'd say I'm not sure.",
    "def add(a, b):\n    return a + b  # 12 + 345 = 357\n\n",
    "    indented   code()\twith\ttabs\r\nand CRLF lines!!! ??? ... ---",
    '{"name": "add", "arguments": {"a": 1, "b": 22}}',
] * 20
#: Plain ASCII: what the fast path answers for (characters, and runs of them that tokenize apart).
ASCII = st.lists(
    st.sampled_from(
        [
            *"abcXYZ019 '\t\n\r.,;:!?(){}[]<>|_-=+*/\\\"`~@#$%^&",
            *("'s", "'LL", "  ", "\n\n", *SPECIALS, "<tool_call>"),
        ]
    ),
    max_size=60,
).map("".join)


def _trained(pre_tokenizer: Any, normalizer: Any = None, dropout: float | None = None) -> HFTokenizer:
    """A small byte-level BPE tokenizer with ``pre_tokenizer``, trained on ``CORPUS``."""
    backend = HFTokenizer(models.BPE(dropout=dropout))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.add_tokens(["<tool_call>"])
    return backend


PIPELINES = {
    "qwen2 (split, then bytes)": lambda: _trained(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pieces.QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        normalizers.NFC(),
    ),
    "llama 3 (split, then bytes)": lambda: _trained(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pieces.LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    ),
    "gpt-2 (bytes with their regex)": lambda: _trained(
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ),
    "smollm (digits, then bytes)": lambda: _trained(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ),
        normalizers.NFKC(),
    ),
    "digit runs": lambda: _trained(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    ),
}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def pipeline(request: pytest.FixtureRequest) -> tuple[HFTokenizer, PieceEncoder]:
    backend = PIPELINES[request.param]()
    encoder = PieceEncoder.of(backend)
    assert encoder is not None, f"no fast path for {request.param}"
    return backend, encoder


def _library(backend: HFTokenizer, text: str) -> list[int]:
    ids: list[int] = backend.encode(text, add_special_tokens=False).ids
    return ids


@settings(max_examples=300, deadline=None)
@given(text=ASCII)
def test_plain_ascii_gets_the_library_s_ids(pipeline: tuple[HFTokenizer, PieceEncoder], text: str) -> None:
    backend, encoder = pipeline
    assert encoder.encode(text) == _library(backend, text)
    assert encoder.encode(text) == _library(backend, text)  # again, from the pieces remembered


#: Text around other characters: what the library encodes of it, cut where no piece crosses.
MIXED = st.lists(
    st.sampled_from(
        [
            *"abXY09 '\t\n.,;!",
            *("word", " word", "'s", "  ", "\n\n", "<|im_end|>"),
            # Accented, typographic, spaces and breaks of other kinds, a combining mark, CJK,
            # an emoji, fullwidth letters, Hangul jamo, control characters, a joiner.
            *"\u00e9\u00ef\u2019\u201c\u2014\u2026\u00a0\u2028\u0085\u0301\u4f60\uff21\u1100\u1161",
            *("\U0001f600", "\x0b", "\x1f", "\x7f", "\u200d", "\u00b2", "\ufb01"),
        ]
    ),
    max_size=60,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=MIXED)
def test_text_with_other_characters_gets_the_library_s_ids(
    pipeline: tuple[HFTokenizer, PieceEncoder], text: str
) -> None:
    backend, encoder = pipeline
    assert encoder.encode(text) == _library(backend, text)


def test_the_library_encodes_the_stretch_around_other_characters(
    pipeline: tuple[HFTokenizer, PieceEncoder],
) -> None:
    backend, encoder = pipeline
    asked: list[str] = []

    class Recording:
        def encode_batch_fast(self, texts: list[str], **kwargs: Any) -> Any:
            asked.extend(texts)
            return backend.encode_batch_fast(texts, **kwargs)

    encoder._backend = Recording()
    text = "alpha beta caf\u00e9 gamma delta \u2014 epsilon zeta"
    try:
        assert encoder.encode(text) == _library(backend, text)
    finally:
        encoder._backend = backend
    # Cut before a space between two ASCII letters, the nearest on each side of each run.
    assert asked == [" caf\u00e9 gamma", " delta \u2014 epsilon"]


@pytest.mark.parametrize(
    "text",
    ["caf\u00e9", "e\u0301", "\U0001f600 ok", "ctrl\x1fchar", "form\x0cfeed", "vertical\x0btab", "del\x7f"],
)
def test_other_text_is_left_whole_to_the_library_under_another_split(text: str) -> None:
    # A split it reads but cannot tell where to cut.
    split = pre_tokenizers.Split(Regex(r"\w+|\s+|[^\w\s]+"), behavior="isolated", invert=False)
    backend = _trained(
        pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    )
    encoder = PieceEncoder.of(backend)
    assert encoder is not None
    assert encoder.encode("plain words, 12 of them") == _library(backend, "plain words, 12 of them")
    assert encoder.encode(text) is None


def test_the_pieces_remembered_are_bounded(
    pipeline: tuple[HFTokenizer, PieceEncoder], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, encoder = pipeline
    monkeypatch.setattr(pieces, "MAX_PIECES", 5)
    for i in range(50):
        text = f"word{i} other{i * 7} and more {i}"
        assert encoder.encode(text) == _library(backend, text)
        assert len(encoder._pieces) <= 5


@pytest.mark.parametrize(
    "change",
    [
        "prefix space",
        "metaspace",
        "split merged with previous",
        "inverted split",
        "lstrip token",
        "dropout",
        "lowercase normalizer",
        "word-level model",
        "truncation",
    ],
)
def test_a_pipeline_it_does_not_read_has_no_fast_path(change: str) -> None:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if change == "prefix space":
        backend = _trained(pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True))
    elif change == "metaspace":
        backend = _trained(pre_tokenizers.Metaspace())
    elif change == "split merged with previous":
        split = pre_tokenizers.Split(Regex(r"\s+"), behavior="merged_with_previous")
        backend = _trained(pre_tokenizers.Sequence([split, byte_level]))
    elif change == "inverted split":
        split = pre_tokenizers.Split(Regex(r"\w+"), behavior="isolated", invert=True)
        backend = _trained(pre_tokenizers.Sequence([split, byte_level]))
    elif change == "lstrip token":
        backend = _trained(byte_level)
        backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    elif change == "dropout":
        backend = _trained(byte_level, dropout=0.5)
    elif change == "lowercase normalizer":
        backend = _trained(byte_level, normalizers.Lowercase())
    elif change == "word-level model":
        backend = HFTokenizer(models.WordLevel({"<|im_end|>": 0, "a": 1}, unk_token="<|im_end|>"))
        backend.pre_tokenizer = byte_level
    else:
        backend = _trained(byte_level)
        backend.enable_truncation(8)
    assert PieceEncoder.of(backend) is None


def test_a_pattern_python_s_regex_does_not_compile_means_no_fast_path() -> None:
    backend = PIPELINES["qwen2 (split, then bytes)"]()
    assert PieceEncoder.of(backend) is not None
    # The same tokenizer as its JSON would read with a split Python's ``regex`` refuses.
    broken = json.loads(backend.to_str())
    broken["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"(\w+"

    class Unreadable:
        model = backend.model

        def to_str(self) -> str:
            return json.dumps(broken)

        def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
            return backend.encode_batch_fast(*args, **kwargs)

    assert PieceEncoder.of(Unreadable()) is None


def test_a_pipeline_that_encodes_a_sample_otherwise_has_no_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = PIPELINES["gpt-2 (bytes with their regex)"]()
    assert PieceEncoder.of(backend) is not None
    # GPT-2's regex read wrongly (contractions left out): the samples' "It's" tells.
    monkeypatch.setattr(pieces, "GPT2_PATTERN", r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    assert PieceEncoder.of(backend) is None


def test_the_proxy_s_tokenizer_encodes_plain_text_without_the_library(tiny_model_dir: Path) -> None:
    ours = Tokenizer.from_model_dir(tiny_model_dir)
    reference = HFTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "<|im_start|>user\nWhat is 2 + 3? It's <tool_call>add</tool_call><|im_end|>\n"
    expected = _library(reference, text)

    class Refusing:
        def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the library was asked")

    ours._backend = Refusing()
    assert ours._pieces is not None
    ours._pieces._backend = Refusing()
    assert ours.encode(text) == expected
    with pytest.raises(AssertionError, match="the library was asked"):
        ours.encode("caf\u00e9")
