"""One rollout in detail: its calls, the conversation as the model saw it, and token segments.

Owns turning a :class:`~store.projections.RolloutView` into what the rollout screen shows. The
token sequences come from ``trainer.samples.build_samples`` (the trainer's own merge rule, so the
dashboard shows exactly what is trained: loss mask and per-token policy version); this module only
groups them into runs. Text is decoded with the run's tokenizer when one is at hand, else the
conversation falls back to the recorded request messages and response text. Each call's
assistant turns that were not spliced exactly as sampled are listed with how they matched or why
they did not (``turn_notes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from store.projections import RolloutView
from trainer.samples import NOT_SAMPLED, build_samples

#: ids -> text, when the run's tokenizer is available.
Decoder = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive tokens with the same loss mask and policy version."""

    sample: int
    start: int
    tokens: tuple[int, ...]
    loss_mask: int
    #: ``trainer.samples.NOT_SAMPLED`` (-1) for prompt tokens.
    version: int
    text: str

    @property
    def label(self) -> str:
        if self.loss_mask:
            return f"sampled v{self.version}"
        return "prompt" if self.version == NOT_SAMPLED else f"masked v{self.version}"


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of the conversation."""

    role: str
    text: str


@dataclass(frozen=True, slots=True)
class RolloutDetail:
    view: RolloutView
    segments: list[Segment]
    conversation: list[Turn]
    #: "tokenizer" when the text was decoded from the token ids, else "recorded".
    text_source: str
    samples: int
    truncations: list[str]
    #: One line per assistant turn a call did not splice exactly (see ``turn_notes``).
    turn_notes: list[str] = field(default_factory=list)


def segments_of(view: RolloutView, decode: Decoder | None = None) -> list[Segment]:
    """The rollout's samples split into runs of equal (loss mask, version)."""
    out: list[Segment] = []
    try:
        samples = build_samples(view.calls)
    except ValueError:
        return out
    for index, sample in enumerate(samples):
        start = 0
        n = len(sample.tokens)
        for t in range(1, n + 1):
            if t == n or (sample.loss_mask[t], sample.versions[t]) != (
                sample.loss_mask[start],
                sample.versions[start],
            ):
                tokens = sample.tokens[start:t]
                text = decode(tokens) if decode is not None else " ".join(map(str, tokens))
                out.append(
                    Segment(index, start, tokens, sample.loss_mask[start], sample.versions[start], text)
                )
                start = t
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content]
        return "".join(parts)
    return "" if content is None else json.dumps(content)


def recorded_conversation(view: RolloutView) -> list[Turn]:
    """The last call's request messages plus its response: the conversation as the harness sent it."""
    if not view.calls:
        return []
    last = view.calls[-1]
    turns: list[Turn] = []
    request = last.request
    if isinstance(request.get("system"), str):  # Anthropic surface
        turns.append(Turn("system", request["system"]))
    messages = request.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                text = _content_text(message.get("content"))
                if message.get("tool_calls"):
                    text += "\n" + json.dumps(message["tool_calls"])
                turns.append(Turn(str(message.get("role", "?")), text))
    elif "prompt" in request:
        turns.append(Turn("prompt", _content_text(request["prompt"])))
    elif "input" in request:
        turns.append(Turn("input", _content_text(request["input"])))
    turns.append(Turn("assistant", last.response_text))
    return turns


def decoded_conversation(view: RolloutView, decode: Decoder) -> list[Turn]:
    """Each sample's tokens decoded as the model saw them: prompt runs and sampled runs."""
    return [Turn("model" if seg.loss_mask else "context", seg.text) for seg in segments_of(view, decode)]


def turn_notes(view: RolloutView) -> list[str]:
    """Per call, each assistant turn not spliced exactly: "call <id> message 2: unmatched, never
    sampled", "... message 4: stop, the returned text + its stop string '</code>' (36/37 ids)"."""
    notes: list[str] = []
    for call in view.calls:
        for turn in call.assistant_turns:
            where = f"call {call.call_id[:10]} message {turn.get('message')}"
            line = f"{where}: {turn.get('kind')}, {turn.get('reason')}"
            if turn.get("kind") != "unmatched":
                line += f" ({turn.get('spliced')}/{turn.get('sampled')} sampled ids spliced)"
            notes.append(line)
    return notes


def rollout_detail(view: RolloutView, decode: Decoder | None = None) -> RolloutDetail:
    try:
        samples = build_samples(view.calls)
    except ValueError:
        samples = []
    return RolloutDetail(
        view=view,
        segments=segments_of(view, decode),
        conversation=decoded_conversation(view, decode) if decode else recorded_conversation(view),
        text_source="tokenizer" if decode else "recorded",
        samples=len(samples),
        truncations=[s.truncation for s in samples if s.truncation],
        turn_notes=turn_notes(view),
    )


def tokenizer_decoder(
    config: dict[str, object], model_name: str, data_dir: Path | None = None
) -> Decoder | None:
    """A decoder from the run's model directory, or None when no tokenizer is found locally.

    Looked for in: the recorded config's ``model`` (a directory), then ``<data_dir>/models/<name>``
    (registered models are materialised there; ``data_dir`` defaults to the recorded one).
    """
    candidates: list[Path] = []
    model = config.get("model")
    if isinstance(model, str) and model:
        candidates.append(Path(model))
    base = data_dir or (Path(str(config["data_dir"])) if config.get("data_dir") else None)
    if base is not None:
        candidates += [
            base / "models" / name for name in (model_name, model) if isinstance(name, str) and name
        ]
    for directory in candidates:
        path = directory / "tokenizer.json"
        if not path.is_file():
            continue
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path))
        except Exception:  # a broken or foreign tokenizer: fall back to recorded text
            continue
        return partial(_decode, tokenizer)
    return None


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """``ids`` as text, special tokens included (as the appliance's own tokenizer decodes)."""
    text: str = tokenizer.decode(list(ids), skip_special_tokens=False)
    return text
