"""Encoding text piece by piece, each piece's ids remembered: the tokenizers library's ids,
without running its whole pipeline on every turn.

Owns the fast path of ``Tokenizer.encode``. A byte-level BPE tokenizer (Qwen's, Llama 3's,
SmolLM's, GPT-2's) encodes a text in four steps: the added tokens (``<|im_start|>``, ...) are
split out, the rest is normalized, split into pre-tokens by regular expressions, and each
pre-token's bytes go through BPE on their own (merges never cross two pre-tokens). The library
runs all four on every call; on a served machine, whose caches the other processes keep
evicting, that costs a few microseconds a word. ``PieceEncoder`` does the first three in Python
(the same expressions, by the ``regex`` module) and asks the library's BPE model only for a
pre-token it has not seen, so a turn costs a dictionary lookup a piece.

It encodes only what is the library's by construction, and leaves the rest to the library:

* plain ASCII (printable characters, tabs and line breaks): no normalizer changes it (NFC, NFKC,
  none), and the expressions' classes (``\\p{L}``, ``\\s``, ...) mean the same to both
  regular-expression engines there. Around other characters the text is cut where no piece can
  cross (before a space between two ASCII letters, under the splits of :data:`CUTTABLE`) and the
  library encodes those stretches; under any other split, such a text goes to it whole;
* for a tokenizer whose pipeline it reads completely from the tokenizer's own JSON: an NFC, NFKC
  or no normalizer; pre-tokenizers among ``Split`` (a regex, "Isolated", not inverted),
  ``Digits`` and ``ByteLevel`` (no prefix space); a BPE model without dropout; added tokens
  matched as plain strings (no ``lstrip``, ``rstrip`` or ``single_word``), no truncation or
  padding. Anything else: ``PieceEncoder.of`` gives None;
* and only after it encoded a sample of texts exactly as the library does (``of`` checks; a
  mixed sample that differs turns the cutting off).
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from itertools import chain
from typing import Any

import regex
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["PieceEncoder", "library_ids"]

#: One pass over the text for added tokens: their alternation (None: none) and each one's id.
AddedPass = tuple[regex.Pattern[str] | None, dict[str, int]]

#: The pre-tokenizer regex of ``ByteLevel(use_regex=True)`` (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Qwen2's and Llama 3's pre-token splits (``Split``, "Isolated"): words with their leading
#: space, every digit on its own (Llama 3: up to three), runs of punctuation, newlines.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
#: Splits under which a text may be cut before a space between two ASCII letters (see
#: ``PieceEncoder.encode``): in each, a letter run ends at a space and a space before a letter
#: starts the next piece, whatever the text around (no alternative reaches back, none ahead past
#: that letter).
CUTTABLE = frozenset({QWEN2_PATTERN, LLAMA3_PATTERN, GPT2_PATTERN, "[0-9]", "[0-9]+"})
#: Where a text may be cut: before a space between two ASCII letters.
_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
#: What the fast path does not take: anything but printable ASCII, tabs and line breaks.
_OTHER = re.compile(r"[^\t\n\r\x20-\x7e]+")
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
#: Texts with other characters, both ways at the start where the split allows cutting (a
#: difference turns the cutting off).
MIXED_SAMPLES = (
    "caf\u00e9 au lait, na\u00efve \u2014 \u201cquoted\u201d text\u2026 \U0001f600 done\n",
    "x\u00a0y z\u2028w a\u0301b \u4f60\u597d world of\ttabs\x0bvt and more words",
    "<|im_start|>user\n\u00bfQu\u00e9 tal? It's fine\x7f and \uff21\uff22 wide<|im_end|>\n",
)


class PieceEncoder:
    """The fast path for one tokenizer; build with :meth:`of`."""

    def __init__(
        self,
        backend: HFTokenizer,
        added: list[AddedPass],
        splits: list[regex.Pattern[str]],
    ) -> None:
        self._backend = backend
        self._model = backend.model
        self._added = added
        self._splits = splits
        #: Text with other characters is cut around them (see ``encode``); else left whole.
        self._cuttable = all(pattern.pattern in CUTTABLE for pattern in splits) and not any(
            " " in token for _pattern, ids in added for token in ids
        )
        #: Each pre-token's ids (tuples: the collector stops walking them once it has seen them).
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._bytes = _byte_chars()

    @classmethod
    def of(cls, backend: HFTokenizer) -> PieceEncoder | None:
        """The fast path for ``backend``, or None where its pipeline is not one this reads (a
        pattern Python's ``regex`` does not compile among them), or where it encodes a sample
        differently."""
        try:
            return cls._of(backend)
        except (regex.error, KeyError, TypeError, ValueError, AttributeError):
            return None

    @classmethod
    def _of(cls, backend: HFTokenizer) -> PieceEncoder | None:
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
        if not all(encoder.encode(text) == library_ids(backend, text) for text in SAMPLES):
            return None
        if encoder._cuttable:
            encoder._cuttable = all(
                encoder.encode(text) == library_ids(backend, text) for text in MIXED_SAMPLES
            )
        return encoder

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids, or None where the library must encode it whole.

        Plain ASCII text is encoded here. Other text, under a split that allows it
        (:data:`CUTTABLE`, and no added token with a space), is cut before a space between two
        ASCII letters on each side of every run of other characters: the library encodes those
        stretches, this the rest. No piece, added token or normalization crosses such a cut (a
        letter run ends at the space, which starts the next piece with the letter after it;
        nothing composes with a space), so the parts' ids joined are the whole text's."""
        if text.isascii() and _CONTROL.search(text) is None:
            out: list[int] = []
            self._encode(text, 0, out)
            return out
        if not self._cuttable:
            return None
        cuts = [match.start() for match in _CUT.finditer(text)]
        out = []
        done = 0  # the text before it is encoded
        for run in _OTHER.finditer(text):
            if run.start() < done:
                continue  # inside the last stretch the library encoded
            at = bisect_right(cuts, run.start())
            start = max(done, cuts[at - 1] if at else 0)
            after = bisect_left(cuts, run.end())
            end = cuts[after] if after < len(cuts) else len(text)
            if start > done:
                self._encode(text[done:start], 0, out)
            out.extend(library_ids(self._backend, text[start:end]))
            done = end
        if done < len(text):
            self._encode(text[done:], 0, out)
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
        if start < len(text):
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


def library_ids(backend: HFTokenizer, text: str) -> list[int]:
    """``text``'s ids as the library encodes it, no special tokens added. The batch encoder
    without character offsets (which nothing here reads): the same ids as ``encode``, in about
    four fifths of its time for a turn of a few dozen tokens."""
    (encoding,) = backend.encode_batch_fast([text], add_special_tokens=False)
    ids: list[int] = encoding.ids
    return ids


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
