"""The registry of live rollouts: one rule for a rollout that is not live (a 409 to its own key
once it has ended, whatever the request; a 404 only for one this process never ran)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.chat.tokenizer import Tokenizer
from appliance.rollouts.registry import REMEMBERED_ENDED, RolloutRegistry
from contracts.errors import Conflict, NotFound, Unauthorized


def test_an_ended_rollout_is_a_conflict_to_its_key_and_a_never_existing_one_not_found(
    tiny_model_dir: Path,
) -> None:
    registry = RolloutRegistry(Tokenizer.from_model_dir(tiny_model_dir))
    active = registry.register("g000000-r0", task_id="t", group="g000000", task={})
    assert registry.authorize("g000000-r0", active.token) is active
    registry.unregister("g000000-r0")
    with pytest.raises(Conflict, match="has already ended"):
        registry.authorize("g000000-r0", active.token)
    with pytest.raises(Unauthorized):
        registry.authorize("g000000-r0", "la-not-its-key")
    with pytest.raises(NotFound, match=r"^rollout 'g999999-r0' does not exist$"):
        registry.authorize("g999999-r0", active.token)
    # Ended rollouts are remembered up to a bound, oldest forgotten first.
    for i in range(REMEMBERED_ENDED):
        last = registry.register(f"r{i}", task_id="t", group="g", task={})
        registry.unregister(f"r{i}")
    with pytest.raises(NotFound):
        registry.authorize("g000000-r0", active.token)
    with pytest.raises(Conflict):
        registry.authorize(last.rollout, last.token)
