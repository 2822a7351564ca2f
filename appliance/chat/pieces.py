"""Encoding plain ASCII text piece by piece, each piece's ids remembered: the tokenizers
library's ids, without running its whole pipeline on every turn.

Owns the fast path of ``Tokenizer.encode``. A byte-level BPE tokenizer (Qwen's, Llama 3's,
SmolLM's, GPT-2's) encodes a text in four steps: the added tokens (``<|im_start|>``, ...) are
split out, the rest is normalized, split into pre-tokens by regular expressions, and each
pre-token's bytes go through BPE on their own (merges never cross two pre-tokens). The library
runs all four on every call; on a served machine, whose caches the other processes keep
evicting, that costs a few microseconds a word. ``PieceEncoder`` does the first three in Python
(the same expressions, by the ``regex`` module) and asks the library's BPE model only for a
pre-token it has not seen, so a turn costs a dictionary lookup a piece.

It answers only where its answer is the library's by construction, and says None otherwise
(the caller then asks the library):

* only for text of printable ASCII, tabs and line breaks: no normalizer changes it (NFC,
  NFKC, none), and the expressions' classes (``\\p{L}``, ``\\s``, ...) mean the same to both
  regular-expression engines there;
* only for a tokenizer whose pipeline it reads completely from the tokenizer's own JSON:
  an NFC, NFKC or no normalizer; pre-tokenizers among ``Split`` (a regex, "Isolated", not
  inverted), ``Digits`` and ``ByteLevel`` (no prefix space); a BPE model without dropout; added
  tokens matched as plain strings (no ``lstrip``, ``rstrip`` or ``single_word``), no truncation
  or padding. Anything else: ``PieceEncoder.of`` gives None;
* and only after it encoded a sample of texts exactly as the library does (``of`` checks).
"""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

import regex
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["PieceEncoder"]

#: One pass over the text for added tokens: their alternation (None: none) and each one's id.
AddedPass = tuple[regex.Pattern[str] | None, dict[str, int]]

#: The pre-tokenizer regex of ``ByteLevel(use_regex=True)`` (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: What the fast path leaves to the library in ASCII text: control characters but tabs and line
#: breaks (the two engines' ``\s`` could disagree on them).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
#: Pieces remembered at most (then forgotten all at once and learnt again).
MAX_PIECES = 50_000
#: Texts both ways at the start; a difference turns the fast path off.
SAMPLES = (
    "Hello, world! It's 2024: don't panic.\n\n  indented\tcode()  \r\n",
    "def f(x):\n    return x**2  # squared\n\n\n",
    "<|im_start|>user\nI've got 12345 files; they'll be <tool_call>{\"a\": 1}</tool_call><|im_end|>\n",
    "   leading and trailing spaces   ",
    "MIXED Case WITH 'S and 'LL THEY'RE\n\t\n  \n",
    "a  b   c    d\n\n\n e",
    "x" * 300 + " " + "=" * 40 + "\n",
)


class PieceEncoder:
    """The fast path for one tokenizer; build with :meth:`of`."""

    def __init__(
        self,
        backend: HFTokenizer,
        added: list[AddedPass],
        splits: list[regex.Pattern[str]],
    ) -> None:
        self._model = backend.model
        self._added = added
        self._splits = splits
        #: Each pre-token's ids (tuples: the collector stops walking them once it has seen them).
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._bytes = _byte_chars()

    @classmethod
    def of(cls, backend: HFTokenizer) -> PieceEncoder | None:
        """The fast path for ``backend``, or None where its pipeline is not one this reads, or
        where it encodes a sample differently."""
        config = json.loads(backend.to_str())
        if config.get("truncation") or config.get("padding") or _splits_special(backend):
            return None
        normalizer = config.get("normalizer")
        if normalizer is not None and normalizer.get("type") not in ("NFC", "NFKC"):
            return None
        model = config.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
            return None
        splits = _pre_tokenizers(config.get("pre_tokenizer"))
        added = _added_tokens(config.get("added_tokens") or [])
        if splits is None or added is None:
            return None
        encoder = cls(backend, added, splits)
        for text in SAMPLES:
            (expected,) = backend.encode_batch_fast([text], add_special_tokens=False)
            if encoder.encode(text) != expected.ids:
                return None
        return encoder

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids, or None where the text is not plain ASCII (ask the library)."""
        if not text.isascii() or _CONTROL.search(text) is not None:
            return None
        out: list[int] = []
        self._encode(text, 0, out)
        return out

    def _encode(self, text: str, level: int, out: list[int]) -> None:
        """Split out the added tokens of ``level`` and the ones after it, then the pre-tokens."""
        if level == len(self._added):
            self._pre_tokens(text, out)
            return
        pattern, ids = self._added[level]
        start = 0
        if pattern is not None:
            for match in pattern.finditer(text):
                if match.start() > start:
                    self._encode(text[start : match.start()], level + 1, out)
                out.append(ids[match.group()])
                start = match.end()
        if start == 0:
            self._encode(text, level + 1, out)
        elif start < len(text):
            self._encode(text[start:], level + 1, out)

    def _pre_tokens(self, text: str, out: list[int]) -> None:
        pieces = [text]
        for pattern in self._splits:
            pieces = [part for piece in pieces for part in _isolated(pattern, piece)]
        known = self._pieces
        kept = len(out)
        try:
            out.extend(chain.from_iterable(map(known.__getitem__, pieces)))
        except KeyError:  # a piece not seen yet: what the others added goes, and comes again
            del out[kept:]
            for piece in pieces:
                ids = known.get(piece)
                if ids is None:
                    if len(known) >= MAX_PIECES:
                        known.clear()
                    mapped = "".join(self._bytes[b] for b in piece.encode())
                    ids = known[piece] = tuple(token.id for token in self._model.tokenize(mapped))
                out.extend(ids)


def _isolated(pattern: regex.Pattern[str], text: str) -> list[str]:
    """``text`` split as a ``Split(..., "Isolated")`` pre-tokenizer splits it: every match its
    own piece, and so is every run of text between two."""
    parts: list[str] = pattern.findall(text)
    if sum(map(len, parts)) == len(text):  # matches end to end (most patterns cover any text)
        return parts
    parts = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            parts.append(text[start : match.start()])
        parts.append(match.group())
        start = match.end()
    if start < len(text):
        parts.append(text[start:])
    return parts


def _pre_tokenizers(config: dict[str, Any] | None) -> list[regex.Pattern[str]] | None:
    """The splits of a pre-tokenizer config, in order; None for one this does not read."""
    if config is None:
        return []
    steps = config.get("pretokenizers") if config.get("type") == "Sequence" else [config]
    splits: list[regex.Pattern[str]] = []
    for step in steps or []:
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern") or {}
            if step.get("behavior") != "Isolated" or step.get("invert") or "Regex" not in pattern:
                return None
            splits.append(regex.compile(pattern["Regex"]))
        elif kind == "Digits":
            splits.append(regex.compile(r"[0-9]" if step.get("individual_digits") else r"[0-9]+"))
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                return None
            if step.get("use_regex", True):
                splits.append(regex.compile(GPT2_PATTERN))
        else:
            return None
    if not steps or steps[-1].get("type") != "ByteLevel":
        return None  # BPE over bytes needs the byte-level step last
    return splits


def _added_tokens(tokens: list[dict[str, Any]]) -> list[AddedPass] | None:
    """Two passes, as the library splits them: the tokens matched on the text as it came (not
    normalized), then those matched on the normalized text; each the leftmost, longest first."""
    passes: list[AddedPass] = []
    for normalized in (False, True):
        ids: dict[str, int] = {}
        for token in tokens:
            if bool(token.get("normalized")) != normalized:
                continue
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                return None
            ids[token["content"]] = token["id"]
        contents = sorted((c for c in ids if c), key=len, reverse=True)
        passes.append((regex.compile("|".join(map(regex.escape, contents))) if contents else None, ids))
    return passes


def _splits_special(backend: HFTokenizer) -> bool:
    """Whether the tokenizer reads special tokens in the text as plain text."""
    return bool(getattr(backend, "encode_special_tokens", False))


def _byte_chars() -> list[str]:
    """The byte-level alphabet: the character each byte stands as (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
