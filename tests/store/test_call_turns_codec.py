"""The call's assistant-turn report and stop string: stored, read back, and absent from old rows."""

from __future__ import annotations

import json

from store.codec import decode, encode
from store.events import LLMCallCompleted
from store.tokens import Tokens


def call(**fields: object) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=1.0,
        rollout="r",
        call_id="c",
        surface="openai.chat",
        prompt_ids=Tokens((1, 2, 3)),
        response_ids=Tokens((7, 8)),
        response_logprobs=(-0.5, -0.25),
        policy_version=0,
        finish_reason="stop",
        request={"model": "m"},
        response_text="x",
        queue_s=0.0,
        total_s=0.5,
        **fields,  # type: ignore[arg-type]
    )


def test_turns_and_stop_string_round_trip() -> None:
    turns = ({"message": 2, "kind": "stop", "reason": "+ '</code>'", "spliced": 2, "sampled": 2},)
    event = call(assistant_turns=turns, stop_sequence="</code>")
    row = encode(event)
    assert decode(row.type, row.version, row.ts, row.data, row.blob) == event


def test_a_row_written_before_the_fields_existed_reads_with_none_reported() -> None:
    row = encode(call(unmatched_assistant_turns=1))
    data = json.loads(row.data)
    del data["assistant_turns"], data["stop_sequence"]
    old = row._replace(data=json.dumps(data))
    event = decode(old.type, old.version, old.ts, old.data, old.blob)
    assert isinstance(event, LLMCallCompleted)
    assert (event.unmatched_assistant_turns, event.assistant_turns, event.stop_sequence) == (1, (), "")
