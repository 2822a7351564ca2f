"""The ``/v1/completions`` body the vLLM engine sends for a request (no server needed)."""

from __future__ import annotations

import json

import orjson
import pytest

from appliance.engines.base import GenerateRequest, SamplingParams
from appliance.engines.vllm_process import completion_body, encode_json

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
