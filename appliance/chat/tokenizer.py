"""The tokenizer as the proxy uses it: text <-> ids, nothing else.

Owns loading a model directory's ``tokenizer.json`` with the ``tokenizers`` library (no
transformers import on the request path) and the special ids the chat format needs. Encoding
never adds special tokens of its own: the chat renderer writes every special token explicitly.
Plain ASCII text is encoded by ``appliance.chat.pieces`` (the library's ids, a pre-token at a
time, each one's ids remembered) where the tokenizer's pipeline is one it reads; other text,
and every other tokenizer, by the library.
Decoding a byte-level vocabulary (most models') joins the ids' bytes from a table built once,
the same text as the library's ``decode`` in a fraction of its time; other vocabularies go to the
library.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

from appliance.chat.pieces import PieceEncoder, library_ids
from appliance.chat.template import ENDOFTEXT, IM_END
from contracts.errors import ConfigError


class Tokenizer:
    def __init__(self, backend: _HFTokenizer) -> None:
        self._backend = backend
        im_end = backend.token_to_id(IM_END)
        if im_end is None:
            raise ConfigError(f"the tokenizer has no {IM_END} token; only ChatML models are supported")
        #: The id that ends an assistant turn; generation stops on it.
        self.im_end_id: int = im_end
        #: What an empty text prompt starts from: the document separator (``<|endoftext|>``, what
        #: the model saw before every document in pretraining), else the end of a turn.
        start = backend.token_to_id(ENDOFTEXT)
        self.document_start_id: int = im_end if start is None else start
        #: Asked once: the backend builds its whole vocabulary to count it.
        self._vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._bytes = _byte_table(backend, self._vocab_size)
        #: Plain ASCII text encoded a pre-token at a time, each one's ids remembered.
        self._pieces = PieceEncoder.of(backend)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"no tokenizer.json in {model_dir}")
        return cls(_HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._pieces is not None and (plain := self._pieces.encode(text)) is not None:
            return plain
        return library_ids(self._backend, text)

    def decode(self, ids: Sequence[int]) -> str:
        table = self._bytes
        if table is not None and (not ids or min(ids) >= 0):  # (a negative index would count back)
            try:
                return b"".join(map(table.__getitem__, ids)).decode("utf-8", "replace")
            except (IndexError, TypeError):  # an id the vocabulary does not hold: the backend's way
                pass
        text: str = self._backend.decode(list(ids), skip_special_tokens=False)
        return text

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly ``text`` (e.g. ``<tool_call>``), None if none is."""
        found: int | None = self._backend.token_to_id(text)
        return found

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


#: Stands between tokens while the vocabulary is translated at once: no byte's character.
_SEPARATOR = "\uffff"


def _byte_table(backend: _HFTokenizer, size: int) -> list[bytes] | None:
    """Each id's bytes, for a byte-level tokenizer (GPT-2's alphabet: Qwen, Llama 3, SmolLM and
    most others), whose decoding is then the UTF-8 of the ids' bytes joined, bad sequences
    replaced, as the backend decodes them (``decode`` joins them itself, with no string made per
    token). None for any other decoder, or a vocabulary with a gap or a token outside the
    alphabet: the backend decodes."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    alphabet = _byte_alphabet()
    added = {i: token.content for i, token in backend.get_added_tokens_decoder().items()}
    tokens = [""] * size
    for token, i in backend.get_vocab(with_added_tokens=False).items():
        if 0 <= i < size and i not in added:
            tokens[i] = token
    if sum(map(bool, tokens)) + sum(0 <= i < size for i in added) < size:  # a gap in the ids
        return None
    # The whole vocabulary translated in one call: each character to its byte (as Latin-1).
    joined = _SEPARATOR.join(tokens)
    if not set(joined) <= {*alphabet, _SEPARATOR}:
        return None
    pieces = joined.translate({ord(char): byte for byte, char in enumerate(alphabet)}).split(_SEPARATOR)
    if len(pieces) != size:  # a token held the separator
        return None
    table = [piece.encode("latin-1") for piece in pieces]
    for i, content in added.items():
        if 0 <= i < size:
            table[i] = content.encode()
    return table


def _byte_alphabet() -> list[str]:
    """The character standing for each byte 0-255 in a byte-level vocabulary (GPT-2's mapping:
    printable bytes stand for themselves, the others for the characters from U+0100 on)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    alphabet: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


class IncrementalDecoder:
    """Text deltas of a growing token sequence, in time proportional to the new tokens.

    Decodes only a short window of recent tokens, and holds a delta back while it ends in an
    incomplete UTF-8 sequence (U+FFFD), so streamed text never contains broken characters.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        self._ids.append(token)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""
