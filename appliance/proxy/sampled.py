"""What a call records of its sampling, kept without an object per token.

Owns ``Sampled`` (every token sampled for a call as three columns: ids, log-probs and the policy
version that sampled each) and ``sampling_record`` (the sampling parameters as the call's event
keeps them). It knows nothing of HTTP, surfaces or the store.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from appliance.engines.base import SamplingParams

_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


#: A call's sampled tokens' ids, log-probs and policy versions (``Sampled.columns``).
Columns = tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]


@dataclass(slots=True)
class Sampled:
    """Every token sampled for a call as three columns: its id, its log-prob and the policy
    version that sampled it (a call preempted by a switch continues under newer weights). Kept as
    columns, so a group of tokens is added, and the whole read out, without an object per token."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        count = min(len(ids), len(logprobs))  # an id without its log-prob is not kept
        self.ids += ids if count == len(ids) else ids[:count]
        self.logprobs += logprobs if count == len(logprobs) else logprobs[:count]
        self.versions += itertools.repeat(version, count)

    def columns(self) -> Columns:
        return tuple(self.ids), tuple(self.logprobs), tuple(self.versions)


def sampling_record(params: SamplingParams) -> dict[str, Any]:
    """``asdict(params)`` in JSON's own values (the stop ids a list, the constraint a dict), so
    the call's event holds what the log reads back and is handed to live subscribers as it is
    (``store.codec.as_stored``), not read back from its row."""
    record = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    record["stop_token_ids"] = list(params.stop_token_ids)
    if params.constraint is not None:
        record["constraint"] = asdict(params.constraint)
    return record
