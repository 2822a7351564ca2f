"""The tokenizer as the proxy uses it: text <-> ids, nothing else.

Owns loading a model directory's ``tokenizer.json`` with the ``tokenizers`` library (no
transformers import on the request path) and the special ids the chat format needs. Encoding
never adds special tokens of its own: the chat renderer writes every special token explicitly.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

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

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"no tokenizer.json in {model_dir}")
        return cls(_HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        # The batch encoder without character offsets (which nothing here reads): the same ids
        # as ``encode``, in about four fifths of its time for a turn of a few dozen tokens.
        (encoding,) = self._backend.encode_batch_fast([text], add_special_tokens=False)
        ids: list[int] = encoding.ids
        return ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=False)
        return text

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly ``text`` (e.g. ``<tool_call>``), None if none is."""
        found: int | None = self._backend.token_to_id(text)
        return found

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


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
