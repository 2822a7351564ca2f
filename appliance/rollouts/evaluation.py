"""Evaluation without training: ``lightning-appliance eval``.

Owns which tasks an evaluation runs (on the validation split, the tasks of a validation round,
``validation.round_tasks``, or every held-out task; on the train split, every training task of
the run's task set or of the built-in arithmetic tasks) and running them: each task ``repeat``
times on the policy the run serves now, through the same controller, adapter and proxy as
training rollouts, with the evaluation sampling (``validation_temperature``,
``validation_max_tokens``), then one ``EvaluationCompleted`` event with the reward mean and
standard deviation and the agent played (:func:`agent_label`). The rollouts are recorded with
purpose "evaluation", so no step ever trains on them and validation rounds do not count them.
Nothing else of the run changes: no step, no push, no checkpoint.

An evaluation plays the run's harness: ``recorded_run.run_harness`` reads what the run's latest start
(``up``'s ``ApplianceStarted``) recorded (the harness section: agent, adapter, tasks and how
they are split and sandboxed; the model, the seed and the validation settings), which ``eval``
puts under its config file, environment and flags.
"""

from __future__ import annotations

import shlex
import statistics
import time
from collections.abc import Sequence
from typing import Any

from appliance.config import ApplianceConfig, HarnessConfig
from appliance.rollouts.controller import RolloutController
from appliance.rollouts.validation import (
    arithmetic_training_tasks,
    arithmetic_validation_tasks,
    held_out_tasks,
    round_tasks,
)
from appliance.scheduler.live import LiveState
from contracts.errors import ConfigError
from harness_adapters.base import Task
from harness_adapters.tasks import TaskSet
from store.events import EvaluationCompleted
from store.eventstore import EventStore

SPLITS = ("train", "validation")


def agent_label(harness: HarnessConfig) -> str:
    """The agent ``harness`` plays, in a few words: the python agent's dotted path, else the
    adapter and its command or agent ("command: my-agent {prompt}")."""
    spec = harness.adapter_spec()
    name = str(spec.get("adapter") or spec.get("name") or "python")
    what = spec.get("agent") or spec.get("command")
    if name == "python":
        return str(what or harness.agent)
    if isinstance(what, list | tuple):
        what = shlex.join(str(part) for part in what)
    return f"{name}: {what}" if what else name


def evaluation_tasks(config: ApplianceConfig, split: str, *, every: bool = False) -> list[Task]:
    """The tasks of an evaluation on ``split``. For "validation", those of a validation round
    of ``up`` (``validation.round_tasks``: the first ``validation_tasks`` held out), so the two
    figures compare; with ``every``, every held-out task. For "train", every training task:
    the task set's training split, or each built-in arithmetic pair not held out."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    harness = config.harness
    if split == "validation":
        try:
            return held_out_tasks(config) if every else round_tasks(config)
        except ConfigError as exc:
            raise ConfigError(
                f'{exc.message} (mark held-out tasks with "split": "validation", set '
                "validation_fraction, or evaluate the training tasks with --split train)"
            ) from None
    if harness.tasks is None:
        # Each training pair once: the stream draws pairs at random, with repeats.
        wanted = 100 - len(arithmetic_validation_tasks(seed=config.seed))
        seen: dict[tuple[int, int], Task] = {}
        for task in arithmetic_training_tasks(seed=config.seed):
            seen.setdefault((task.data["a"], task.data["b"]), task)
            if len(seen) == wanted:
                break
        return list(seen.values())
    taskset = TaskSet.load(
        harness.tasks, split=split, validation_fraction=harness.validation_fraction, seed=config.seed
    )
    return [taskset.task_at(i, seed=config.seed) for i in range(len(taskset))]


async def evaluate(
    *,
    controller: RolloutController,
    live: LiveState,
    store: EventStore,
    config: ApplianceConfig,
    tasks: Sequence[Task],
    split: str,
    repeat: int = 1,
) -> EvaluationCompleted:
    """Run every task ``repeat`` times and record the result (see the module docstring)."""
    if repeat < 1:
        raise ConfigError(f"repeat must be at least 1; got {repeat}")
    if not tasks:
        raise ConfigError(f"the {split} split has no tasks to evaluate")
    state = live.state
    earlier = {view.group for view in state.rollouts.values() if view.purpose == "evaluation"}
    group = f"eval{len(earlier):04d}"
    scheduler = config.scheduler
    sampling: dict[str, Any] = {
        "temperature": scheduler.validation_temperature,
        "max_tokens": scheduler.validation_max_tokens,
    }
    version = state.policy_version
    rollouts = await controller.start_validation(
        group,
        [task for task in tasks for _ in range(repeat)],
        temperature=scheduler.validation_temperature,
        max_tokens=scheduler.validation_max_tokens,
        purpose="evaluation",
    )
    while True:
        seen = live.position
        views = [state.rollouts[r] for r in rollouts if r in state.rollouts]
        if len(views) == len(rollouts) and all(v.status != "running" for v in views):
            break
        await live.wait_change(seen)
    rewards = [float(v.reward) for v in views if v.status == "finished" and v.reward is not None]
    event = EvaluationCompleted(
        ts=time.time(),
        step=state.step,
        policy_version=version,
        split=split,
        repeat=repeat,
        rollouts=tuple(rollouts),
        reward_mean=statistics.fmean(rewards) if rewards else 0.0,
        reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        failed=len(views) - len(rewards),
        sampling=sampling,
        agent=agent_label(config.harness),
    )
    (position,) = await store.append([event])
    await live.wait_for(position)
    return event
