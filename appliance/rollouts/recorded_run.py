"""What a run recorded about the harness it played, read without loading anything heavy.

Owns :func:`run_start` (the run's latest ``up`` start in its log, not an evaluation's) and
:func:`run_harness` (the fields ``eval`` takes from it, :data:`RUN_FIELDS`): ``eval`` reads them
before it claims the data directory and imports torch, so it imports only the config and the
store's reading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from appliance.config import HarnessConfig, recorded_value
from store.events import ApplianceStarted
from store.reading import select_sync
from store.schema import COLUMNS

#: What an evaluation takes from the run it evaluates (user-facing names): how its agents run
#: and on which tasks (the harness section), and what decides the tasks and their sampling.
RUN_FIELDS = (
    *(f.name for f in dataclasses.fields(HarnessConfig)),
    "model",
    "seed",
    "validation_tasks",
    "validation_temperature",
    "validation_max_tokens",
)


def run_start(db_path: Path) -> ApplianceStarted | None:
    """The run's latest start in the log at ``db_path`` (``up``'s, not an evaluation's); None
    when there is no log or no such start."""
    if not db_path.is_file():
        return None
    sql = f"SELECT {COLUMNS} FROM events WHERE type = ? ORDER BY position"
    starts = [s.event for s in select_sync(db_path, sql, (ApplianceStarted.type,))]
    return next((e for e in reversed(starts) if isinstance(e, ApplianceStarted) and e.command == "up"), None)


def run_harness(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`RUN_FIELDS` a run's recorded config (``ApplianceStarted.config``, nested or
    flat) holds, by user-facing name; a field it does not hold is left out."""
    harness = recorded.get("harness")
    fields: dict[str, Any] = {}
    for name in RUN_FIELDS:
        value = recorded_value(recorded, name)
        held = name in recorded or (isinstance(harness, Mapping) and name in harness)
        if value is not None or held:
            fields[name] = value
    return fields
