"""``lightning-appliance eval``: the run's current policy on a split's tasks, with no training.

Owns ``eval``'s flags, the harness it plays (the run's, as its latest ``up`` recorded it:
agent, adapter, tasks, model, seed and validation settings, under ``--config``, the environment
and the flags, ``appliance.rollouts.recorded_run.run_harness``), where its tasks come from (a
validation round's, every held-out task with ``--all``, or every task of ``--split train``),
and the line (or ``--json``) it prints, naming the agent played. A round in which no rollout
finished is said so, with the reasons, and exits 1 (``EXIT_NONE_FINISHED``).
The data directory's lock is claimed before torch is imported, as ``up`` does. Playing the
tasks and recording the result is the appliance's (``Appliance.evaluate``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from appliance.cli.common import (
    claim,
    config_flag,
    config_from_flags,
    engine_flags,
    harness_flags,
    run_async,
)
from appliance.config import ApplianceConfig


def add_parser(sub: Any) -> None:
    """``eval`` and its flags."""
    evaluate = sub.add_parser(
        "eval",
        help="run the tasks of a validation round (or every task of a split: --all, --split train) "
        "once, or --repeat times, on the run's current policy, with no training; print and record "
        "the reward's mean and standard deviation",
    )
    config_flag(evaluate)
    evaluate.add_argument("--data-dir", type=Path, help="run directory (default ./appliance-data)")
    engine_flags(evaluate)
    evaluate.add_argument("--device", help="cpu, cuda or auto")
    evaluate.add_argument("--port", type=int, help="proxy port (0: any free port)")
    harness_flags(evaluate)
    evaluate.add_argument(
        "--split", default="validation", help="train or validation (default: validation, held-out tasks)"
    )
    evaluate.add_argument("--repeat", type=int, default=1, help="rollouts per task (default 1)")
    evaluate.add_argument(
        "--all",
        action="store_true",
        dest="every",
        help="validation split: every held-out task, not just the validation_tasks a round of up plays",
    )
    evaluate.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance eval``."""
    # As for `up`: a run directory another appliance holds is refused before torch loads.
    config = _eval_config(args, resolved=False)
    with claim(config):  # a refused start leaves nothing it created
        return run_async(
            _eval(config.with_resolved_device(), args.split, args.repeat, args.json, every=args.every)
        )


#: Exit status of an ``eval`` in which no rollout finished (every one failed).
EXIT_NONE_FINISHED = 1


def _eval_config(args: argparse.Namespace, *, resolved: bool = True) -> ApplianceConfig:
    """The config of ``eval``'s flags (``config_from_flags``) over the run's recorded harness
    (``run_harness``: what the run's latest ``up`` played, unless the file, the environment or
    a flag says otherwise)."""
    from appliance.rollouts.recorded_run import run_harness, run_start

    keys = ("data_dir", "model", "engine", "device", "port", "agent", "tasks", "sandbox")
    config = config_from_flags(args, keys, resolved=False)
    start = run_start(config.db_path)
    if start is None:
        return config.with_resolved_device() if resolved else config
    return config_from_flags(args, keys, resolved=resolved, base=run_harness(start.config))


def eval_source(config: ApplianceConfig, split: str, every: bool) -> str:
    """Where an evaluation's tasks come from, as its header line says it."""
    if split != "validation":
        return f"every {split} task"
    if every:
        return "every held-out task"
    first = config.scheduler.validation_tasks
    return f"a validation round's tasks (the first validation_tasks = {first} held out; --all: every one)"


async def _eval(
    config: ApplianceConfig, split: str, repeat: int, as_json: bool, *, every: bool = False
) -> int:
    from appliance.app import Appliance
    from appliance.rollouts.evaluation import agent_label, evaluation_tasks
    from store.outcomes import failures_text, grouped_reasons, none_finished_text

    # A bad split or task set fails before anything loads.
    tasks = evaluation_tasks(config, split, every=every)
    async with Appliance(config, command="eval") as appliance:
        print(
            f"lightning-appliance eval: agent {agent_label(config.harness)}, "
            f"{len(tasks)} {split} tasks x {repeat}, "
            f"{eval_source(config, split, every)}, on policy "
            f"v{appliance.live.state.policy_version} (step {appliance.live.state.step}), "
            f"proxy {appliance.proxy_url}",
            file=sys.stderr,
            flush=True,
        )
        result = await appliance.evaluate(tasks, split=split, repeat=repeat)
        state = appliance.live.state
        views = [state.rollouts[r] for r in result.rollouts if r in state.rollouts]
        # Failed as the result counts them: every rollout that did not finish with a reward.
        failed = [v for v in views if not (v.status == "finished" and v.reward is not None)]
    # Every rollout failed: there is no reward to report (a mean of 0 would read as one).
    none_finished = bool(result.rollouts) and result.failed == len(result.rollouts)
    none_text = none_finished_text(len(failed), grouped_reasons(failed))
    if as_json:
        fields = ("split", "repeat", "step", "policy_version", "reward_mean", "reward_std", "failed", "agent")
        reasons = [{"reason": reason, "count": count} for reason, count in grouped_reasons(failed)]
        printed = {
            **{k: getattr(result, k) for k in fields},
            "tasks": len(tasks),
            "rollouts": len(result.rollouts),
            "failure_reasons": reasons,
        }
        if none_finished:
            printed.update(reward_mean=None, reward_std=None, error=none_text)
        print(json.dumps(printed))
    else:
        head = (
            f"eval {result.split}: {len(tasks)} tasks x {repeat} = {len(result.rollouts)} rollouts  "
            f"agent {result.agent}  policy v{result.policy_version}  step {result.step}  "
        )
        if none_finished:
            print(head + none_text, flush=True)
        else:
            reward = f"reward mean {result.reward_mean:.3f}  std {result.reward_std:.3f}  "
            print(head + reward + failures_text(failed), flush=True)
    return EXIT_NONE_FINISHED if none_finished else 0
