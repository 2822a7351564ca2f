"""Rollout detail: token segments from the trainer's samples, and the conversation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from store.events import LLMCallCompleted
from store.projections import RolloutView, RunState
from tests.tui.run_events import run_events
from trainer.samples import NOT_SAMPLED, build_samples
from tui.detail import recorded_conversation, rollout_detail, segments_of, tokenizer_decoder
from tui.screens.rollout import summary_text


def with_calls(rollout: str) -> RolloutView:
    """The rollout's view with its calls read back, as the dashboard opens a trained rollout."""
    events = run_events()
    view = RunState.from_events(events).rollouts[rollout]
    assert view.released and not view.calls
    calls = [e for e in events if isinstance(e, LLMCallCompleted) and e.rollout == rollout]
    return replace(view, calls=calls, released=False)


def test_segments_show_mask_and_the_version_of_each_token() -> None:
    view = with_calls("r-1-1")  # its second call was preempted: tokens of v0 then v1
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
    view = with_calls("r-0-0")
    turns = recorded_conversation(view)
    assert [(t.role, t.text) for t in turns] == [
        ("system", "Answer."),
        ("user", "What is 4 + 4?"),
        ("assistant", "8"),
    ]
    detail = rollout_detail(view)
    assert detail.text_source == "recorded" and detail.samples == 1


def test_decoding_with_the_runs_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    decode = tokenizer_decoder({"model": str(tiny_model_dir)}, "tiny")
    assert decode is not None
    assert tokenizer_decoder({"model": "tiny", "data_dir": str(tmp_path)}, "tiny") is None
    from appliance.chat.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    ids = tokenizer.encode("hello world")
    assert decode(ids) == "hello world"
    ids.append(tokenizer.im_end_id)  # special tokens are shown, as the appliance decodes them
    assert decode(ids) == tokenizer.decode(ids)


def test_assistant_turns_not_spliced_exactly_are_listed_with_their_reason() -> None:
    view = with_calls("r-0-0")
    stop = "the returned text + its stop string '</code>'"
    turns = (
        {"message": 2, "kind": "unmatched", "reason": "never sampled", "spliced": 0, "sampled": 0},
        {"message": 4, "kind": "stop", "reason": stop, "spliced": 9, "sampled": 10},
    )
    call = replace(view.calls[0], assistant_turns=turns)
    detail = rollout_detail(replace(view, calls=[call]))
    head = f"call {call.call_id[:10]}"
    assert detail.turn_notes == [
        f"{head} message 2: unmatched, never sampled",
        f"{head} message 4: stop, {stop} (9/10 sampled ids spliced)",
    ]
    assert detail.turn_notes[0] in summary_text(detail).plain
    assert rollout_detail(view).turn_notes == []
