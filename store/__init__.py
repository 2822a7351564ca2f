"""The event store: an append-only, durable log of everything the appliance did.

``events`` defines what can be logged, ``codec`` how an event becomes a row, ``eventstore`` the
SQLite log itself, and ``projections`` the state folded from it. Import from here.
"""

from store.codec import StoredEvent, register_upcaster
from store.events import (
    EVENT_TYPES,
    ApplianceStarted,
    ApplianceStopped,
    CallRewardReported,
    CheckpointSaved,
    ControlRequested,
    EvaluationCompleted,
    Event,
    Floats,
    JsonObject,
    LLMCallCompleted,
    ModelExported,
    PhaseChanged,
    PolicyVersionPublished,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    TokenIds,
    TrainStepCompleted,
    TrainStepFailed,
    ValidationCompleted,
)
from store.eventstore import EventStore, read_events_sync
from store.projections import RolloutView, RunState

__all__ = [
    "EVENT_TYPES",
    "ApplianceStarted",
    "ApplianceStopped",
    "CallRewardReported",
    "CheckpointSaved",
    "ControlRequested",
    "EvaluationCompleted",
    "Event",
    "EventStore",
    "Floats",
    "JsonObject",
    "LLMCallCompleted",
    "ModelExported",
    "PhaseChanged",
    "PolicyVersionPublished",
    "RewardReported",
    "RolloutCreated",
    "RolloutFinished",
    "RolloutView",
    "RunState",
    "StoredEvent",
    "TokenIds",
    "TrainStepCompleted",
    "TrainStepFailed",
    "ValidationCompleted",
    "read_events_sync",
    "register_upcaster",
]
