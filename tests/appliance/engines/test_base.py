"""The request types every engine shares: recorded params and the contract's checks on top_k."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from appliance.engines.base import GenerateRequest, SamplingParams, validate_request
from contracts.errors import BadRequest

VOCAB = 1002


def test_a_record_made_before_top_k_reads_as_top_k_off() -> None:
    cut = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3)
    record = json.loads(json.dumps(dataclasses.asdict(cut)))
    assert record["top_k"] == 40
    assert SamplingParams.from_record(record) == cut
    del record["top_k"]
    assert SamplingParams.from_record(record) == dataclasses.replace(cut, top_k=0)


@pytest.mark.parametrize("top_k", [0, 1, 40, VOCAB - 1, VOCAB, 2**63])
def test_top_k_accepts_any_whole_number_from_zero(top_k: int) -> None:
    """0 and values of at least the vocabulary's size are off; nothing above is refused."""
    request = GenerateRequest(prompt_ids=[1, 2], params=SamplingParams(top_k=top_k))
    validate_request(request, max_context=1024, vocab_size=VOCAB)


@pytest.mark.parametrize("top_k", [-1, -(2**63), 1.0, 2.5, True, None, float("nan")])
def test_top_k_refuses_negatives_and_non_integers(top_k: Any) -> None:
    request = GenerateRequest(prompt_ids=[1, 2], params=SamplingParams(top_k=top_k))
    with pytest.raises(BadRequest) as caught:
        validate_request(request, max_context=1024, vocab_size=VOCAB)
    assert caught.value.param == "top_k"


def test_prompt_ids_are_checked_unless_a_tokenizer_within_the_vocabulary_vouches() -> None:
    """A chat prompt the proxy rendered holds only its tokenizer's ids and sampled ones: when that
    tokenizer's vocabulary fits the engine's, the scan over every id (as long as the
    conversation) is skipped; any other prompt is scanned."""
    outside = GenerateRequest(prompt_ids=[1, VOCAB + 5], params=SamplingParams())
    with pytest.raises(BadRequest):
        validate_request(outside, max_context=1024, vocab_size=VOCAB)
    validate_request(dataclasses.replace(outside, tokenizer_vocab=VOCAB), max_context=1024, vocab_size=VOCAB)
    with pytest.raises(BadRequest):
        larger = dataclasses.replace(outside, tokenizer_vocab=VOCAB + 10)
        validate_request(larger, max_context=1024, vocab_size=VOCAB)
    bad: list[list[Any]] = [[1, True], [1, 2.0], [-1, 2]]
    for ids in bad:
        with pytest.raises(BadRequest):
            validate_request(
                GenerateRequest(prompt_ids=ids, params=SamplingParams()), max_context=1024, vocab_size=VOCAB
            )
