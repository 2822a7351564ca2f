"""What an engine reports of what it serves, alike in the torch and vLLM engines.

Owns the ``Engine`` properties both engines answer from the same fields (``policy_version``,
``max_context``, ``is_sleeping``) and the sleep and wake arguments both take (a level of 1 or 2;
the tags "weights" and "kv_cache"), refused with the same ``BadRequest``. When an engine sleeps,
what it frees and what it must load again on waking are each engine's own.
"""

from __future__ import annotations

from collections.abc import Iterable

from contracts.errors import BadRequest

#: What ``wake`` may bring back; a sleep releases both.
WAKE_TAGS = frozenset({"weights", "kv_cache"})


class ServedState:
    """The version served, the context it serves and the sleep state, set by the engine.

    ``_released`` holds which of ``WAKE_TAGS`` are released now (empty while awake)."""

    _policy_version: int
    _max_context: int
    _released: set[str]

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)


def check_sleep_level(level: int) -> None:
    """``BadRequest`` unless ``level`` is a sleep level (1: weights kept aside, 2: dropped)."""
    if level not in (1, 2):
        raise BadRequest(f"sleep level must be 1 or 2, got {level}", param="level")


def check_wake_tags(tags: Iterable[str]) -> None:
    """``BadRequest`` naming any of ``tags`` that is not one of ``WAKE_TAGS``."""
    unknown = set(tags) - WAKE_TAGS
    if unknown:
        raise BadRequest(f"unknown wake tags {sorted(unknown)}; use 'weights' and 'kv_cache'", param="tags")
