"""Encoding a turn: the ``tokenizers`` library's pipeline against the proxy's tokenizer (plain ASCII
a pre-token at a time, ``appliance.chat.pieces``), side by side in one run.

For each size, texts of that many words (ChatML framing, so added tokens are split out too) from
two sources taking turns: the proxy benchmark's words, and slices of this repository's ASCII
source (code: indentation, punctuation, digits). Each text is encoded by both, which must give the
same ids (the script stops otherwise), the two taking turns per text; the figure is the thread
CPU per text (``time.thread_time``), the median over texts. ``--cold`` writes 16 MiB between two
texts first, as a served proxy's caches find them (the clients' and the engine's work between
two calls); warm figures come from the texts alone.

    .venv/bin/python scripts/bench_tokenize.py [--model tiny|smollm2-135m|<dir>] [--words 1,40,400,4000]
        [--texts 200] [--cold] [--data-dir appliance-data]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench_proxy_load import WORDS

from appliance.chat.pieces import library_ids
from appliance.chat.template import IM_END, IM_START
from appliance.chat.tokenizer import Tokenizer
from appliance.config import ApplianceConfig
from appliance.engines.models import resolve

ROOT = Path(__file__).resolve().parents[1]
#: Bytes written between two texts with ``--cold``.
COLD_BYTES = 16 << 20


def source_words() -> list[str]:
    """This repository's Python source, ASCII lines only, split at spaces (kept with each word)."""
    lines = [
        line
        for path in sorted((ROOT / "appliance").rglob("*.py"))
        for line in path.read_text().splitlines(keepends=True)
        if line.isascii()
    ]
    return [part for line in lines for part in line.split(" ")]


def texts(words: int, count: int, rng: random.Random, source: Sequence[str]) -> list[str]:
    """``count`` user turns of ``words`` words, every other one a slice of ``source``."""
    out = []
    for i in range(count):
        if i % 2:
            start = rng.randrange(max(1, len(source) - words))
            body = " ".join(source[start : start + words])
        else:
            body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(f"{IM_START}user\n{body}{IM_END}\n")
    return out


def measure(
    encoders: dict[str, Callable[[str], list[int]]], batch: Sequence[str], cold: bool
) -> dict[str, float]:
    """Median thread CPU per text of each encoder; raises if they disagree on a text."""
    spent: dict[str, list[float]] = {name: [] for name in encoders}
    scratch = bytearray(COLD_BYTES) if cold else None
    for i, text in enumerate(batch):
        names = list(encoders) if i % 2 else list(encoders)[::-1]
        ids = []
        for name in names:
            if scratch is not None:
                scratch[::64] = bytes([i & 0xFF]) * (COLD_BYTES // 64)
            began = time.thread_time()
            ids.append(encoders[name](text))
            spent[name].append(time.thread_time() - began)
        if any(other != ids[0] for other in ids[1:]):
            raise RuntimeError(f"the encoders disagree on {text[:80]!r}")
    return {name: statistics.median(values) for name, values in spent.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a model directory")
    parser.add_argument("--words", default="1,40,400,4000", help="words per text, comma-separated")
    parser.add_argument("--texts", type=int, default=200, help="texts per size")
    parser.add_argument("--cold", action="store_true", help="16 MiB written before each text")
    parser.add_argument("--data-dir", type=Path, default=Path("appliance-data"))
    args = parser.parse_args(argv)
    resolved = resolve(args.model, ApplianceConfig(data_dir=args.data_dir).models_dir)
    tokenizer = Tokenizer.from_model_dir(resolved.path)
    if tokenizer._pieces is None:
        print(f"{resolved.name}: its pipeline is not one the pieces read; the library encodes every text")
        return 1
    backend = tokenizer._backend
    encoders: dict[str, Callable[[str], list[int]]] = {
        "library": lambda text: library_ids(backend, text),
        "pieces": tokenizer.encode,
    }
    rng = random.Random(0)
    source = source_words()
    print(f"{resolved.name}, {args.texts} texts a size, {'cold' if args.cold else 'warm'} caches, "
          "thread CPU per text (medians), the same ids from both")  # fmt: skip
    print("| words | library | pieces | library / pieces |")
    print("|---|---|---|---|")
    for words in (int(w) for w in args.words.split(",")):
        batch = texts(words, args.texts, rng, source)
        for text in batch[:10]:  # each encoder warm, the pieces' dictionary with the common words
            for encode in encoders.values():
                encode(text)
        spent = measure(encoders, batch, args.cold)
        print(
            f"| {words} | {spent['library'] * 1e6:.1f} us | {spent['pieces'] * 1e6:.1f} us "
            f"| {spent['library'] / spent['pieces']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
