"""The messages between the appliance and its trainer ranks: typed commands and replies.

Owns the frozen dataclasses that travel over each rank's pipe (pickled by
``multiprocessing.Connection``) and :class:`TrainerRankFailed`. The driver
(``trainer.ranks.RankGroup``) sends one command to every rank and waits for one reply from
each; the worker (``trainer.rank_worker``) runs it on its ``VerlFSDPTrainer``. Only a weight push
has a conversation: rank 0 sends :class:`BucketReady` per bucket and waits for :class:`Continue`
before it overwrites the bucket, so the driver can hand each bucket to the engine in turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contracts.errors import ApplianceError
from trainer.checkpoints import CheckpointStore
from trainer.sharded import ShardedStore
from trainer.step_plan import RankStep
from trainer.weight_group import GroupSpec

if TYPE_CHECKING:
    from trainer.buckets import WeightBucket


class TrainerRankFailed(ApplianceError):
    """A trainer rank died, raised, or stopped answering; the ranks are stopped and must be
    restarted (``RankedTrainer.restart``) from the last published version."""

    status = 503
    code = "trainer_rank_failed"


@dataclass(frozen=True, slots=True)
class RunStep:
    """Run this rank's share of a training step (reply: ``RankResult``)."""

    work: RankStep


@dataclass(frozen=True, slots=True)
class Save:
    """Save the trainer as ``version`` at ``step`` into ``store`` (reply: the path)."""

    store: CheckpointStore | ShardedStore
    version: int
    step: int


@dataclass(frozen=True, slots=True)
class Load:
    """Load ``version`` from ``store`` (reply: ``(version, step)``)."""

    store: CheckpointStore | ShardedStore
    version: int | None


@dataclass(frozen=True, slots=True)
class Offload:
    """Parameters, gradients and optimizer state to host memory (reply: None)."""


@dataclass(frozen=True, slots=True)
class Onload:
    """Back to the training device (reply: None)."""


@dataclass(frozen=True, slots=True)
class PushWeights:
    """Stream the engine's weights in buckets (rank 0: :class:`BucketReady` messages; reply:
    the number of buckets)."""

    bucket_bytes: int
    dtype: str | None
    directory: str | None
    #: LoRA merged into whole weights (an export) instead of the adapters alone.
    merged: bool = False
    #: Broadcast over the weight group rank 0 hosts (``HostWeightGroup``) instead of a file.
    via_group: bool = False


@dataclass(frozen=True, slots=True)
class HostWeightGroup:
    """Rank 0: host the weight group and join it, once every member joins (reply: whether this
    rank joined)."""

    spec: GroupSpec


@dataclass(frozen=True, slots=True)
class BucketReady:
    """Rank 0 -> driver during a push: this bucket is filled; answer :class:`Continue` once it
    has been consumed."""

    bucket: WeightBucket


@dataclass(frozen=True, slots=True)
class Continue:
    """Driver -> rank 0 during a push: the last bucket is consumed, fill the next."""


@dataclass(frozen=True, slots=True)
class StateDict:
    """The engine's full weights (reply: the dict on rank 0, None on the others)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the process group and exit (reply: None)."""


Command = RunStep | Save | Load | Offload | Onload | PushWeights | HostWeightGroup | StateDict | Shutdown


@dataclass(frozen=True, slots=True)
class Ok:
    """A command succeeded with ``value``."""

    value: Any = None


@dataclass(frozen=True, slots=True)
class Failed:
    """A command raised: the exception's type name, message and the rank's traceback."""

    kind: str
    message: str
    traceback: str
