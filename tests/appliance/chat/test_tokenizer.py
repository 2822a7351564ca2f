"""The proxy's tokenizer: the same ids as the ``tokenizers`` library's own ``encode``, the same text
as its ``decode`` (which ours does itself for a byte-level vocabulary)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from appliance.chat.tokenizer import Tokenizer

TEXTS = [
    "",
    "hi",
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
    "  leading and trailing spaces  \n\n\ttabs\r\nand CRLF",
    "e\u0301 (a combining accent, composed by NFC), \u00e9, \u212b, \ufb01",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01 \U0001f600 \u0645\u0631\u062d\u0628\u0627",
    "<|endoftext|>after the separator<|im_end|>",
    "x" * 5000,
]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir: Path) -> tuple[Tokenizer, HFTokenizer]:
    return Tokenizer.from_model_dir(tiny_model_dir), HFTokenizer.from_file(
        str(tiny_model_dir / "tokenizer.json")
    )


def _reference(backend: HFTokenizer, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids if text else []


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_the_library(tokenizers: tuple[Tokenizer, HFTokenizer], text: str) -> None:
    ours, backend = tokenizers
    assert ours.encode(text) == _reference(backend, text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_encode_matches_the_library_on_any_text(tokenizers: tuple[Tokenizer, HFTokenizer], text: str) -> None:
    ours, backend = tokenizers
    assert ours.encode(text) == _reference(backend, text)


def _decoded(backend: HFTokenizer, ids: list[int]) -> str:
    text: str = backend.decode(ids, skip_special_tokens=False)
    return text


def test_a_byte_level_vocabulary_is_decoded_from_its_bytes(tokenizers: tuple[Tokenizer, HFTokenizer]) -> None:
    ours, backend = tokenizers
    table = ours._bytes
    assert table is not None and len(table) == ours.vocab_size
    assert table[ours.im_end_id] == b"<|im_end|>"
    assert table[backend.token_to_id("<tool_call>")] == b"<tool_call>"
    # An id past the vocabulary: the library's way (which leaves it out).
    assert ours.decode([ours.im_end_id, ours.vocab_size + 5]) == _decoded(backend, [ours.im_end_id])
    with pytest.raises(OverflowError):  # and a negative id: the library's error
        ours.decode([ours.im_end_id, -1])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decode_matches_the_library(tokenizers: tuple[Tokenizer, HFTokenizer], data: st.DataObject) -> None:
    ours, backend = tokenizers
    # Single bytes make broken UTF-8 (ids 3-258 of the tiny vocabulary are its bytes), among
    # merges and special and added tokens.
    ids = data.draw(
        st.lists(
            st.one_of(st.integers(0, 2), st.integers(3, 258), st.integers(0, ours.vocab_size - 1)),
            max_size=40,
        )
    )
    assert ours.decode(ids) == _decoded(backend, ids)
    assert ours.decode(tuple(ids)) == _decoded(backend, ids)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_is_the_text_the_library_gives_back(
    tokenizers: tuple[Tokenizer, HFTokenizer], text: str
) -> None:
    ours, backend = tokenizers
    ids = _reference(backend, text)
    assert ours.decode(ids) == _decoded(backend, ids)


def test_other_decoders_are_left_to_the_library() -> None:
    vocab = {"<|im_end|>": 0, "\u2581hello": 1, "\u2581world": 2}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<|im_end|>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    ours = Tokenizer(backend)
    assert ours._bytes is None
    assert ours.decode([1, 2]) == _decoded(backend, [1, 2]) == "hello world"
