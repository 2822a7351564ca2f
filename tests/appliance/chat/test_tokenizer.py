"""The proxy's tokenizer: the same ids as the ``tokenizers`` library's own ``encode``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

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
