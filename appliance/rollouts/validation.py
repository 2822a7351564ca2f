"""Validation rounds: which held-out tasks they evaluate, and the result a round records.

Owns the task streams of a run split into training and validation, and how the rollouts of a
finished round become a ``ValidationCompleted`` event. It does not run rollouts (the
controller does), decide when a round runs (``scheduler.decide``) nor serve the evaluation
sampling (the proxy applies the rollout's ``ActiveRollout.temperature_override``).

Invariants:

* Training and validation never share a task. A task set's validation split is disjoint from
  its training split (``harness_adapters.tasks``). For the built-in arithmetic tasks a seeded
  fifth of the 100 ``a + b`` pairs is held out: the training stream skips those pairs, whether
  validation is on or not, so a run's training tasks do not depend on its validation settings.
* Every round evaluates the same tasks (the first ``validation_tasks`` of the held-out set, in
  a seeded order: :func:`round_tasks`), so rounds at different steps are comparable; ``eval``
  on the validation split plays the same tasks unless asked for every held-out one.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from appliance.config import ApplianceConfig
from contracts.errors import ConfigError
from harness_adapters.base import Task
from harness_adapters.tasks import TaskSet, arithmetic_tasks
from store.events import ValidationCompleted
from store.projections import RolloutView

log = logging.getLogger(__name__)

#: Fraction of the arithmetic ``(a, b)`` pairs held out for validation.
HELD_OUT_FRACTION = 0.2


def held_out(seed: int, a: int, b: int) -> bool:
    """Whether the arithmetic pair ``(a, b)`` is held out from training for this seed."""
    digest = hashlib.sha256(f"held-out:{seed}:{a}:{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < HELD_OUT_FRACTION


def arithmetic_training_tasks(*, seed: int = 0, start: int = 0) -> Iterator[Task]:
    """The arithmetic task stream without the held-out pairs, from position ``start`` on.

    Ids keep the index of the unfiltered stream, so they are the ids ``arithmetic_task`` gives."""
    kept = (
        task for task in arithmetic_tasks(seed=seed) if not held_out(seed, task.data["a"], task.data["b"])
    )
    return itertools.islice(kept, start, None)


def arithmetic_validation_tasks(*, seed: int = 0) -> list[Task]:
    """Every held-out arithmetic pair as a task, in a seeded order."""
    pairs = [(a, b) for a in range(10) for b in range(10) if held_out(seed, a, b)]
    random.Random(f"validation:{seed}").shuffle(pairs)
    return [
        Task(
            id=f"add-val-{seed}-{a}-{b}",
            data={"a": a, "b": b, "answer": a + b, "question": f"What is {a} + {b}?"},
        )
        for a, b in pairs
    ]


def training_tasks(config: ApplianceConfig, start: int) -> Iterator[Task]:
    """The run's training tasks, one per group, continuing after the ``start`` groups drawn."""
    harness = config.harness
    if harness.tasks is None:
        return arithmetic_training_tasks(seed=config.seed, start=start)
    taskset = TaskSet.load(
        harness.tasks,
        split=harness.task_split,
        validation_fraction=harness.validation_fraction,
        seed=config.seed,
    )
    return taskset.stream(seed=config.seed, start=start)


def held_out_tasks(config: ApplianceConfig) -> list[Task]:
    """Every held-out task, in the seeded order validation rounds take them from: the task
    set's validation split (``validation_fraction`` holds tasks out of a set without one), or
    the built-in arithmetic pairs held out. Raises ``ConfigError`` for a task set with neither."""
    harness = config.harness
    if harness.tasks is None:
        return arithmetic_validation_tasks(seed=config.seed)
    taskset = TaskSet.load(
        harness.tasks,
        split="validation",
        validation_fraction=harness.validation_fraction,
        seed=config.seed,
    )
    return [taskset.task_at(i, seed=config.seed) for i in range(len(taskset))]


def round_tasks(config: ApplianceConfig) -> list[Task]:
    """The tasks a validation round evaluates: the first ``validation_tasks`` held out. The one
    definition ``up``'s rounds and ``eval`` (by default) share, so their figures compare."""
    return held_out_tasks(config)[: config.scheduler.validation_tasks]


def validation_tasks(config: ApplianceConfig) -> list[Task]:
    """The tasks every validation round of a run evaluates ([] when validation is off or
    impossible).

    A task set without a validation split (and no ``validation_fraction``) turns validation
    off with a warning rather than failing the run."""
    if config.scheduler.validate_every == 0:
        return []
    try:
        return round_tasks(config)
    except ConfigError as exc:
        log.warning("validation is off: %s (set validation_fraction to hold tasks out)", exc)
        return []


def round_result(
    views: Sequence[RolloutView], *, step: int, policy_version: int, sampling: Mapping[str, Any]
) -> ValidationCompleted:
    """The event recording a finished round: reward statistics over the rollouts that finished
    with a reward; the others (failed, interrupted, unrewarded) are counted as ``failed``."""
    rewards = [float(v.reward) for v in views if v.status == "finished" and v.reward is not None]
    return ValidationCompleted(
        ts=time.time(),
        step=step,
        policy_version=policy_version,
        rollouts=tuple(v.rollout for v in views),
        reward_mean=statistics.fmean(rewards) if rewards else 0.0,
        reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        failed=len(views) - len(rewards),
        sampling=dict(sampling),
    )
