"""The event store: an append-only, durable log of everything the appliance did.

``events`` defines what can be logged; ``codec`` how an event becomes a row (``packing`` its
token ids as binary, ``prefix`` the check that a call's ids start with its previous call's);
``eventstore`` the SQLite log itself (``schema`` the file's tables and migrations, ``writer``
the one thread that commits, ``reading`` rows back into events); and ``projections`` and
``outcomes`` the state folded from it. Import from here.

The bottom layer of what records a run: it may import only ``contracts`` (and the standard
library, aiosqlite, orjson), never ``appliance``, ``tui``, ``trainer`` nor ``harness_adapters``,
which all read and write through it.
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
