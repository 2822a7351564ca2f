"""Rollout detail: token segments from the trainer's samples, and the conversation."""

from __future__ import annotations

from pathlib import Path

from store.projections import RunState
from tests.tui.run_events import run_events
from trainer.samples import NOT_SAMPLED, build_samples
from tui.detail import recorded_conversation, rollout_detail, segments_of, tokenizer_decoder


def test_segments_show_mask_and_the_version_of_each_token() -> None:
    state = RunState.from_events(run_events())
    view = state.rollouts["r-1-1"]  # its second call was preempted: tokens of v0 then v1
    segments = segments_of(view)
    assert [(s.label, s.tokens) for s in segments] == [
        ("prompt", (1, 2, 3, 4, 5)),
        ("sampled v0", (100, 101, 102, 103)),
        ("prompt", (6, 7)),
        ("sampled v0", (110, 111)),
        ("sampled v1", (112, 113)),
    ]
    (sample,) = build_samples(view.calls)
    flat = [t for s in segments for t in s.tokens]
    assert tuple(flat) == sample.tokens
    assert all(s.version == NOT_SAMPLED for s in segments if not s.loss_mask)
    assert segments[1].text == "100 101 102 103"  # no tokenizer: the ids


def test_conversation_falls_back_to_the_recorded_request() -> None:
    state = RunState.from_events(run_events())
    turns = recorded_conversation(state.rollouts["r-0-0"])
    assert [(t.role, t.text) for t in turns] == [
        ("system", "Answer."),
        ("user", "What is 4 + 4?"),
        ("assistant", "8"),
    ]
    detail = rollout_detail(state.rollouts["r-0-0"])
    assert detail.text_source == "recorded" and detail.samples == 1


def test_decoding_with_the_runs_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    decode = tokenizer_decoder({"model": str(tiny_model_dir)}, "tiny")
    assert decode is not None
    assert tokenizer_decoder({"model": "tiny", "data_dir": str(tmp_path)}, "tiny") is None
    from appliance.chat.tokenizer import Tokenizer

    ids = Tokenizer.from_model_dir(tiny_model_dir).encode("hello world")
    assert decode(ids) == "hello world"
