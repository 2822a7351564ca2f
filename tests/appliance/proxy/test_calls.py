"""Pieces of the call path that need no engine."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from appliance.engines.base import SamplingParams
from appliance.engines.constraints import Constraint
from appliance.proxy.calls import sampling_record


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=7, temperature=0.5, top_k=3, stop_token_ids=(1, 2), seed=-4, top_logprobs=2
        ),
        SamplingParams(constraint=Constraint(kind="json_object", grammar="start: x")),
    ],
)
def test_the_recorded_sampling_is_asdict(params: SamplingParams) -> None:
    assert sampling_record(params) == asdict(params)
