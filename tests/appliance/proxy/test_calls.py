"""Pieces of the call path that need no engine."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from appliance.engines.base import SamplingParams
from appliance.engines.constraints import Constraint
from appliance.proxy.calls import new_call_id
from appliance.proxy.sampled import sampling_record


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
def test_the_recorded_sampling_is_asdict_in_jsons_own_values(params: SamplingParams) -> None:
    record = sampling_record(params)
    # What the log reads back: equal, and of the same types throughout (repr tells a list from a
    # tuple), so the event the proxy records is the one its live subscribers get.
    read_back = json.loads(json.dumps(asdict(params)))
    assert record == read_back and repr(record) == repr(read_back)
    assert SamplingParams.from_record(record) == params


def test_call_ids_are_distinct_unguessable_24_hex_digits_and_differ_between_processes() -> None:
    ids = [new_call_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids)
    # Unguessable: one id says nothing of the next (no shared prefix, no counter).
    assert len({i[:8] for i in ids}) > 9_900 and len({i[-8:] for i in ids}) > 9_900
    steps = {int(b, 16) - int(a, 16) for a, b in itertools.pairwise(ids)}
    assert len(steps) > 9_900
    other = subprocess.run(
        [sys.executable, "-c", "from appliance.proxy.calls import new_call_id; print(new_call_id())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert len(other) == 24 and other[:16] != ids[0][:16]  # another process, another prefix
