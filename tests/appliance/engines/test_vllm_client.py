"""The ``/v1/completions`` body the vLLM engine sends for a request and how it reads vLLM's
answers (no server needed; tests/appliance/engines/test_vllm_engine.py holds them to a real one)."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.engines.base import GenerateRequest, SamplingParams
from appliance.engines.vllm_client import (
    StreamPace,
    completion_body,
    encode_json,
    parse_choice,
    read_chunks,
    token_ids_of,
)
from contracts.errors import EngineUnavailable

VOCAB = 1002


@pytest.mark.parametrize(
    ("top_k", "sent"), [(0, 0), (1, 1), (40, 40), (VOCAB - 1, VOCAB - 1), (VOCAB, 0), (2**63, 0)]
)
def test_top_k_is_always_sent_and_zero_when_off(top_k: int, sent: int) -> None:
    """Left out, vLLM would apply the model's own ``generation_config.json`` top_k; 0 is its "off",
    and a top_k of at least the vocabulary's size is off."""
    request = GenerateRequest(prompt_ids=[1, 2], params=SamplingParams(temperature=0.8, top_k=top_k))
    body = completion_body(request, "policy", VOCAB)
    assert body["top_k"] == sent
    assert body["temperature"] == 0.8 and body["top_p"] == 1.0


@pytest.mark.parametrize("seed", [None, 2**70])  # 2**70: beyond orjson, written by Python's json
def test_a_prompt_already_written_as_json_gives_the_same_body(seed: int | None) -> None:
    prompt = [151644, 872, 198, *range(300, 1300), 151645]
    request = GenerateRequest(prompt_ids=prompt, params=SamplingParams(seed=seed, stop_token_ids=(2,)))
    body = completion_body(request, "policy", VOCAB)
    written = encode_json(body, prompt_json=orjson.dumps(prompt))
    assert written == encode_json(body)
    assert json.loads(written)["prompt"] == prompt


@pytest.mark.parametrize("prompt_logprobs", [None, 0, 3])
def test_only_a_scored_prompt_asks_for_the_prompt_ids_back(prompt_logprobs: int | None) -> None:
    """``return_token_ids`` would echo the whole prompt's ids in every answer; the sampled ids
    come from the log-probs' tokens (``token_id:N``), so only a scored prompt asks for them."""
    request = GenerateRequest(prompt_ids=[1, 2, 3], params=SamplingParams(), prompt_logprobs=prompt_logprobs)
    body = completion_body(request, "policy", VOCAB)
    assert body["return_token_ids"] is (prompt_logprobs is not None)
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 0


def choice(tokens: list[str], logprobs: list[float], finish: str | None = "stop") -> dict[str, object]:
    """A completion as vLLM 0.32 writes it without ``return_token_ids``."""
    block = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None}
    return {"choices": [{"index": 0, "text": "x", "logprobs": block, "finish_reason": finish}]}


def test_the_sampled_ids_are_read_from_the_log_prob_tokens() -> None:
    whole = parse_choice(choice(["token_id:5", "token_id:151645"], [-0.5, -0.25]))
    assert (whole.token_ids, whole.logprobs, whole.finish_reason) == ((5, 151645), (-0.5, -0.25), "stop")
    ids: list[int] = []
    logprobs: list[float] = []
    events = [choice(["token_id:7"], [-1.0], None), choice(["token_id:8", "token_id:0"], [-2.0, -3.0])]
    assert read_chunks(events, ids, logprobs, []) == "stop"
    assert (ids, logprobs) == ([7, 8, 0], [-1.0, -2.0, -3.0])


@given(st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=300))
def test_every_id_written_as_a_token_is_read_back(ids: list[int]) -> None:
    assert token_ids_of([f"token_id:{i}" for i in ids]) == ids


@pytest.mark.parametrize(
    "token",
    ["7", "hello", "token_id:", "token_id:x", "id:7", "token_id:-1", "token_id:1.5", "token_id:١",
     "token_id:007", "token_id:1,token_id:2", "token_id:1token_id:2", " token_id:1", "token_id:\ud800"],
)  # fmt: skip
def test_a_sampled_token_not_written_as_its_id_is_refused(token: str) -> None:
    """A server that writes tokens as text (``return_tokens_as_token_ids`` ignored) fails the call
    with the retryable error, not with ids read from text."""
    with pytest.raises(EngineUnavailable, match="unexpected shape"):
        parse_choice(choice(["token_id:5", token], [-0.5, -0.5]))
    with pytest.raises(EngineUnavailable, match="unexpected shape"):
        read_chunks([choice([token], [-0.5])], [], [], [])


def test_a_sampled_token_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(EngineUnavailable, match="unexpected shape"):
        parse_choice(choice(["token_id:5", 6], [-0.5, -0.5]))  # type: ignore[list-item]


def test_chunks_are_read_together_but_each_must_pair_its_ids_with_log_probs() -> None:
    ids: list[int] = []
    logprobs: list[float] = []
    events = [choice([f"token_id:{i}"], [-0.5], None) for i in range(5)] + [choice([], [], "length")]
    assert read_chunks(events, ids, logprobs, []) == "length"
    assert (ids, logprobs) == ([0, 1, 2, 3, 4], [-0.5] * 5)
    # Three ids and three log-probs in all, but not chunk by chunk.
    uneven = [choice(["token_id:1", "token_id:2"], [-1.0], None), choice(["token_id:3"], [-1.0, -2.0])]
    with pytest.raises(EngineUnavailable, match="2 token ids but 1 log-probs"):
        read_chunks(uneven, [], [], [])


@pytest.mark.parametrize(("batch", "asked"), [(None, 8), (1, None), (3, 3)])
def test_the_stream_interval_asked_for_may_be_smaller_than_the_requests_batch(
    batch: int | None, asked: int | None
) -> None:
    request = GenerateRequest(prompt_ids=[1, 2], on_token=lambda t, lp: None, token_batch=8)
    assert completion_body(request, "policy", VOCAB, batch).get("stream_interval") == asked


def test_a_bounded_batch_follows_the_servers_pace() -> None:
    """Unmeasured, a bounded batch is one token; a fast server allows the whole batch, a slow one
    one token at a time; a slowdown counts at once, a speed-up gradually."""
    pace = StreamPace()
    assert pace.batch(16, 0.02) == 1
    assert pace.batch(16, 0.0) == 16  # no bound: the count alone
    assert pace.batch(1, 0.02) == 1
    pace.measured(255, 0.0)  # a fake server: every token at once
    assert pace.batch(16, 0.02) == 16
    pace.measured(100, 1.0)  # 10 ms a token: two of them within 20 ms
    assert pace.batch(16, 0.02) == 2
    pace.measured(10, 0.5)  # 50 ms a token
    assert pace.batch(16, 0.02) == 1
    for _ in range(30):
        pace.measured(100, 0.1)  # 1 ms a token again
    assert pace.batch(16, 0.02) == 16
    pace.measured(0, 5.0)  # a single-token stream says nothing of the pace
    assert pace.batch(16, 0.02) == 16


def test_one_token_reads_as_in_a_longer_list() -> None:
    for id_ in (0, 7, 151645, 2**63 - 1):
        assert token_ids_of([f"token_id:{id_}"]) == [id_] == token_ids_of([f"token_id:{id_}"] * 2)[:1]
