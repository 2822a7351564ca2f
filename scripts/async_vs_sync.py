"""Async (eta 1) against sync training: held-out reward per trained rollout and per minute, over seeds.

Trains the same model on the multi-turn arithmetic task of docs/results.md (``--agent
conversation``: "What is a + b?", after "wrong" one more try in the same conversation; reward
1, 0.5 or 0) once per ``--modes`` entry and ``--seeds`` entry (default: sync and async, seeds
0, 1, 2: six runs), each in a fresh process, changing only the scheduler's ``mode`` (and
``eta`` for async). Every run trains the same samples per step (``--batch-groups`` tasks x
``--group-size`` rollouts); runs of one seed share the weights, the task stream and the
sampling seeds. Async runs the scheduler's in-flight limit, eta + 1 steps' batches at once
(``--async-inflight`` sets another); both correct stale tokens the same way (``--off-policy``,
default "decoupled": the truncated importance weight, so the stale tokens of an async step keep
their gradient).

Held out: the same 64 of the 100 single-digit sums for every seed and mode (``--split-seed``),
never trained on and nothing tuned on them, played greedily (temperature 0) by the
appliance's own validation rounds: at step 0 and every ``--eval-every`` steps, each round holds
the next training step back until it ends, so one round sees one policy version in both modes
(a held-out score through ``/v1`` beside the run, as ``learn_demo.py`` does, would straddle an
async step), and it runs alone (``validation_holds_admissions``: no training group is admitted
until it ends, so a round costs both modes alike; ``--rounds-beside`` admits beside it).
Everything is read back from the run's event log: per round the held-out reward,
first-try and solved fractions and calls; per step its metrics (entropy, loss, the staleness
figures of async steps); the time of each from the log's timestamps.

Time axis: ``minutes`` is wall time from the first admission to the end of the step whose
policy a round scored, the held-out rounds included: both modes run the same rounds, and
async's training rollouts already under way keep generating beside them, so their cost cannot
be cleanly subtracted
(the summary gives their total, ``eval minutes``). The summary says, per mode, the final
held-out reward (mean ± std [min, max] over seeds) and the minutes each run took to first
reach sync's final held-out reward at its lowest seed (the low end of sync's spread, from
step 1 on); async learns as well as sync if it reaches it, and faster if in fewer minutes.

Writes ``<out>/async_vs_sync.json`` (every run: points, steps, metrics; the spreads),
``<out>/async_vs_sync.png`` (held-out reward against trained rollouts and against wall
minutes: mean over seeds, min-max shaded, each seed thin) and ``<out>/async_vs_sync.md``.

Wall time, measured with smollm2-135m on 2 quiet CPU cores (docs/results.md, second run):
15-46 s per training step, 10-29 s per held-out round, 6-7.5 minutes per run and about 1 minute
to load it; the default (2 modes x 3 seeds x 10 steps, 6 rounds each) takes about 50 minutes,
and each run keeps its checkpoints (about 2.6 GB of disk). Run it in the background:

    nohup nice .venv/bin/python scripts/async_vs_sync.py --out /tmp/async_vs_sync \\
        > /tmp/async_vs_sync.log 2>&1 &
    # a study cut short (a full disk, a reboot) goes on where it stopped: the runs that finished
    # are read back from their event logs
    nohup nice .venv/bin/python scripts/async_vs_sync.py --out /tmp/async_vs_sync2 \\
        --runs-from /tmp/async_vs_sync > /tmp/async_vs_sync2.log 2>&1 &
    # a CPU smoke run (tiny model, which learns nothing; also tests/scripts/test_demo_scripts.py):
    .venv/bin/python scripts/async_vs_sync.py --model tiny --steps 1 --eval-every 1 --group-size 2 \\
        --batch-groups 1 --held-out 4 --seeds 0
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import learn_demo as demo
from seed_spread import Panel, Spread, by_step, plot_panels, spread, write_json

from appliance.app import Appliance
from harness_adapters.examples import retry_arithmetic
from harness_adapters.examples.heldout import Evaluation
from harness_adapters.python import PythonAdapter
from store.events import RolloutCreated, TrainStepCompleted, ValidationCompleted
from store.eventstore import iter_events_sync
from store.projections import RolloutView, RunState


@dataclass(frozen=True, slots=True)
class Point:
    """The policy after ``step`` steps, scored on the held-out sums by one validation round."""

    step: int
    #: Training rollouts trained on to reach this policy.
    rollouts: int
    #: Wall minutes from the first admission to the end of step ``step`` (0 for the baseline).
    minutes: float
    heldout: Evaluation


@dataclass(slots=True)
class ModeRun:
    """One run, read back from its event log."""

    mode: str
    seed: int
    points: list[Point] = field(default_factory=list)
    rows: list[demo.StepRow] = field(default_factory=list)
    #: Every step's ``TrainStepCompleted.metrics`` (staleness, importance weights, ...).
    metrics: list[dict[str, float]] = field(default_factory=list)
    minutes: float = 0.0
    eval_minutes: float = 0.0
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def round_evaluation(views: Sequence[RolloutView], seconds: float) -> Evaluation:
    """A round's rollouts as an ``Evaluation`` (a failed or unrewarded rollout scores 0). The
    reward is 1 only at the first attempt and above 0 only when some attempt was right."""
    n = max(len(views), 1)
    rewards = [v.reward or 0.0 for v in views]
    return Evaluation(
        reward=sum(rewards) / n,
        first_try=sum(1 for r in rewards if r >= 1.0) / n,
        solved=sum(1 for r in rewards if r > 0.0) / n,
        calls=sum(v.call_count for v in views) / n,
        tasks=len(views),
        seconds=seconds,
    )


def read_log(db_path: Path, mode: str, seed: int) -> ModeRun:
    """Fold the run's log into its steps and its held-out points."""
    run = ModeRun(mode=mode, seed=seed)
    state = RunState()
    created: dict[str, float] = {}
    step_end: dict[int, float] = {}
    round_seconds = 0.0
    trained = 0
    start: float | None = None
    for stored in iter_events_sync(db_path):
        event = stored.event
        state.apply(event, stored.position)
        match event:
            case RolloutCreated(rollout=rollout, ts=ts):
                created[rollout] = ts
                start = ts if start is None else start
            case TrainStepCompleted(step=step, rollouts=rollouts, metrics=metrics, ts=ts):
                assert start is not None
                views = [state.rollouts[r] for r in rollouts if r in state.rollouts]
                trained += len(rollouts)
                step_end[step] = ts
                run.metrics.append(dict(metrics))
                run.rows.append(
                    demo.StepRow(
                        step=step,
                        minutes=(ts - start) / 60,
                        train_reward=metrics.get("reward_mean", 0.0),
                        entropy=metrics.get("entropy", float("nan")),
                        loss=metrics.get("loss", float("nan")),
                        calls_per_rollout=sum(v.call_count for v in views) / max(len(views), 1),
                        samples_per_rollout=metrics.get("samples_per_rollout", float("nan")),
                        seconds=event.duration_s,
                    )
                )
            case ValidationCompleted(step=step, rollouts=rollouts, ts=ts):
                assert start is not None
                seconds = ts - min(created[r] for r in rollouts)
                round_seconds += seconds
                minutes = (step_end[step] - start) / 60 if step in step_end else 0.0
                heldout = round_evaluation([state.rollouts[r] for r in rollouts], seconds)
                run.points.append(Point(step, trained, minutes, heldout))
    run.minutes = (max(step_end.values(), default=start or 0.0) - (start or 0.0)) / 60
    run.eval_minutes = round_seconds / 60
    return run


def run_one(args: argparse.Namespace, out: Path, mode: str, seed: int) -> ModeRun:
    """One training run in ``mode`` with ``seed``, its held-out rounds every ``--eval-every``."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = argparse.Namespace(**vars(args) | {"seed": seed})
    rollouts_per_step = args.batch_groups * args.group_size
    config = demo.make_config(
        args,
        out / f"{mode}-seed{seed}",
        mode=mode,
        eta=args.eta,
        validate_every=args.eval_every,
        validation_tasks=args.held_out,
        validation_temperature=0.0,
        validation_max_tokens=retry_arithmetic.MAX_TOKENS,
        max_tokens_per_microbatch=args.microbatch_tokens,
        # One engine batch holds a whole round beside the most training rollouts async runs at once.
        max_batch_size=args.held_out + rollouts_per_step * (args.eta + 1),
        validation_holds_admissions=not args.rounds_beside,
        max_inflight_rollouts=args.async_inflight,
        off_policy=args.off_policy,
    )
    started = time.monotonic()

    def on_step(step: TrainStepCompleted, state: RunState) -> None:
        demo.log_line(
            f"{mode} seed {seed} step {step.step:>3}  {(time.monotonic() - started) / 60:6.1f} min  "
            f"train reward {step.metrics.get('reward_mean', 0.0):.3f}  "
            f"entropy {step.metrics.get('entropy', float('nan')):.3f}  step {step.duration_s:5.1f} s"
        )

    async def train() -> str:
        async with Appliance(
            config, adapter=PythonAdapter(demo.AGENTS[args.agent].agent), on_step=on_step
        ) as app:
            return await app.run()

    reason = asyncio.run(train())
    run = read_log(config.db_path, mode, seed)
    run.reason = reason
    for point in run.points:
        demo.log_line(
            f"{mode} seed {seed} held-out after step {point.step}: {point.heldout.reward:.3f} "
            f"({point.minutes:.1f} min, {point.rollouts} rollouts trained)"
        )
    return run


def read_back(args: argparse.Namespace, directory: Path, mode: str, seed: int) -> ModeRun | None:
    """The run of ``mode`` and ``seed`` an earlier study left in ``directory``, read back from its
    event log, if it trained ``--steps`` steps and a round scored the last one; None otherwise."""
    db = directory / f"{mode}-seed{seed}" / "events.sqlite"
    if not db.is_file():
        return None
    run = read_log(db, mode, seed)
    if not run.points or run.points[-1].step != args.steps:
        return None
    run.reason = f"reached step {args.steps} (read back from {db.parent})"
    return run


def minutes_to(run: ModeRun, target: float) -> float | None:
    """Wall minutes to the first trained policy (step 1 on) whose held-out reward reaches
    ``target``; None if none did."""
    hit = next((p for p in run.points if p.step > 0 and p.heldout.reward >= target), None)
    return None if hit is None else hit.minutes


def summary(runs: dict[str, dict[int, ModeRun]]) -> dict[str, Any]:
    """Per mode: final held-out reward, minutes, and the minutes to reach sync's final reward at
    its lowest seed (``reached``: how many seeds did)."""
    finals = [r.points[-1].heldout.reward for r in runs.get("sync", {}).values() if r.points]
    target = min(finals) if finals else float("nan")
    out: dict[str, Any] = {"target": target}
    for mode, seeds in runs.items():
        hits = [minutes_to(r, target) for r in seeds.values()]
        reached = [h for h in hits if h is not None]
        out[mode] = {
            "heldout_before": spread(r.points[0].heldout.reward for r in seeds.values() if r.points),
            "heldout_final": spread(r.points[-1].heldout.reward for r in seeds.values() if r.points),
            "first_try_final": spread(r.points[-1].heldout.first_try for r in seeds.values() if r.points),
            "minutes": spread(r.minutes for r in seeds.values()),
            "eval_minutes": spread(r.eval_minutes for r in seeds.values()),
            "step_seconds": spread(spread(x.seconds for x in r.rows).mean for r in seeds.values()),
            "minutes_to_target": spread(reached),
            "reached": f"{len(reached)}/{len(hits)}",
        }
    return out


def table(figures: dict[str, Any]) -> list[str]:
    """The summary as Markdown: one row per mode, mean ± std [min, max] over seeds."""
    modes = [m for m in figures if m != "target"]
    columns = list(figures[modes[0]]) if modes else []
    lines = [
        f"Target: sync's final held-out reward at its lowest seed, {figures['target']:.3f}.",
        "",
        "| mode | " + " | ".join(c.replace("_", " ") for c in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    lines += [f"| {m} | " + " | ".join(str(figures[m][c]) for c in columns) + " |" for m in modes]
    return lines


def plot(runs: dict[str, dict[int, ModeRun]], path: Path, title: str) -> None:
    by_rollouts: dict[str, dict[float, Spread]] = {}
    by_minutes: dict[str, dict[float, Spread]] = {}
    traces: dict[str, list[tuple[list[float], list[float]]]] = {}
    for mode, seeds in runs.items():
        points = [{p.step: p for p in r.points} for r in seeds.values()]
        rewards = by_step([{s: p.heldout.reward for s, p in pts.items()} for pts in points])
        minutes = by_step([{s: p.minutes for s, p in pts.items()} for pts in points])
        rollouts = {s: p.rollouts for s, p in points[0].items()} if points else {}
        by_rollouts[mode] = {float(rollouts[s]): v for s, v in rewards.items()}
        by_minutes[mode] = {minutes[s].mean: v for s, v in rewards.items()}
        traces[mode] = [
            ([p.minutes for p in r.points], [p.heldout.reward for p in r.points]) for r in seeds.values()
        ]
    plot_panels(
        path,
        title,
        [
            Panel("training rollouts trained on", "held-out reward (greedy)", by_rollouts, ylim=(0, 1)),
            Panel(
                "wall minutes (held-out rounds included)",
                "held-out reward (greedy)",
                by_minutes,
                traces,
                ylim=(0, 1),
            ),
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = demo.study_parser(__doc__.split("\n\n")[0], modes="sync,async", out=Path("/tmp/async_vs_sync"))
    p.add_argument("--eta", type=int, default=1, help="async staleness bound")
    demo.runs_from_option(p)
    p.add_argument(
        "--async-inflight",
        type=int,
        default=None,
        help="async mode's most training rollouts at once (default: (eta + 1) steps' batches)",
    )
    p.add_argument(
        "--off-policy",
        default="decoupled",
        choices=("decoupled", "bypass"),
        help="the trainer's off-policy correction, both modes",
    )
    p.add_argument(
        "--rounds-beside",
        action="store_true",
        help="admit training groups beside a held-out round (default: a round runs alone)",
    )
    args = p.parse_args(argv)
    if args.eval_every < 1 or args.steps % args.eval_every:
        p.error("--eval-every must divide --steps (the last step's policy is scored)")
    out, runs = demo.run_study(f"async_vs_sync (eta {args.eta})", args, run_one, read_back)
    figures = summary(runs)
    demo.write_tables(out / "async_vs_sync.md", table(figures))
    write_json(out / "async_vs_sync.json", demo.args_json(args), runs, summary=figures)
    plot(
        runs,
        out / "async_vs_sync.png",
        f"{args.model}: sync vs async (eta {args.eta}), {len(args.seeds)} seeds (mean, min-max)",
    )
    return 0


if __name__ == "__main__":
    demo.run_script(main)
