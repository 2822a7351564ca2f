"""What makes the appliance unhealthy right now, for ``/healthz`` and the dashboard.

Owns ``Health``: named conditions, each set by the part that detects it (a switch phase past
its deadline, the circuit breaker holding admissions, a failed engine) and cleared by the same
part when it is over. ``/healthz`` answers 200 ``{"status": "ok"}`` while none is set and 503
``{"status": "unhealthy", "reasons": [...]}`` otherwise, so a supervisor or load balancer sees
a wedged run instead of a green light. It holds no history: every condition is also recorded
as an event (``PhaseOverran``, ``AdmissionsPaused``).
"""

from __future__ import annotations


class Health:
    def __init__(self) -> None:
        self._conditions: dict[str, str] = {}

    def set(self, key: str, reason: str) -> None:
        """Mark the appliance unhealthy because of ``key`` (replacing its reason)."""
        self._conditions[key] = reason

    def clear(self, key: str) -> None:
        self._conditions.pop(key, None)

    @property
    def ok(self) -> bool:
        return not self._conditions

    @property
    def reasons(self) -> list[str]:
        """The reasons, oldest condition first."""
        return list(self._conditions.values())

    def report(self) -> dict[str, object]:
        if self.ok:
            return {"status": "ok"}
        return {"status": "unhealthy", "reasons": self.reasons}
