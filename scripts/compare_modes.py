"""Sync against async on this machine, measured, and the simulator's prediction of the same runs.

Runs the real appliance (torch engine) on the same model, agent, seeds and number of steps in
``sync``, ``async`` at ``eta`` 1 and ``async`` at ``eta`` 2, with an agent whose rollouts have
SWE-agent-like timing (a long-tailed number of calls, tool latency between them:
``harness_adapters/examples/long_tail.py``), ``--repeats`` times, the modes taking turns (repeat
``r`` runs seed ``seed + r``), after one short run that is not measured (the first appliance of
a process decodes erratically). From each run's events it reads seconds per step after a
warm-up and where they went (generation, switches, the step). It fits the simulator's cost
model to this machine from every run's events (decode and prefill, the training step, the
switches: ``appliance.scheduler.simulate.calibrate``), replays each run's own rollouts (calls,
tokens, the harness's time around them) through the simulator under the same policy, and prints
measured and predicted side by side with the async/sync ratios; and, as a check on the model
apart from the machine's changing load, the same predicted from each run's own costs.

Writes ``<out>/compare_modes.json`` (the fitted cost model, the recorded rollouts in figures,
each mode's measured and predicted seconds per step, per repeat too, the ratios) and keeps each
run's data directory under ``<out>/runs/``; ``--refit`` fits and predicts again from those,
without running anything. Figures and what they showed: docs/scheduler.md, "The simulator
against the appliance".

Wall time: about 2.5 minutes with the defaults (tiny model, 3 repeats of 8 steps per mode) on 2
CPU cores at a load average of 3, more on a busier machine. Longer runs (``--repeats 10``,
``--model smollm2-135m``) belong in the background: ``nice -n 10 env MALLOC_ARENA_MAX=2 ... &``.

    .venv/bin/python scripts/compare_modes.py [--steps 8] [--repeats 3] [--out /tmp/compare_modes]
    .venv/bin/python scripts/compare_modes.py --refit --repeats 3 --out /tmp/compare_modes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from appliance.app import Appliance
from appliance.config import load_config
from appliance.scheduler.decide import Mode, SchedulePolicy
from appliance.scheduler.simulate import SimResult, Simulator
from appliance.scheduler.simulate.calibrate import (
    RecordedRollouts,
    RunPhases,
    describe_rollouts,
    fit_cost,
    measure_run,
    recorded_rollouts,
)
from store.events import Event, TrainStepCompleted
from store.eventstore import read_events_sync

#: The runs, by label: (mode, eta).
MODES: dict[str, tuple[Mode, int]] = {"sync": ("sync", 0), "async-1": ("async", 1), "async-2": ("async", 2)}


def run_shape(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "agent": "harness_adapters.examples.long_tail:agent",
        "max_steps": args.steps,
        "group_size": args.group_size,
        "batch_groups": args.batch_groups,
        "seed": args.seed,
        "validate_every": 0,  # no validation round: every step's time is the schedule's
    }


async def run_appliance(mode: Mode, eta: int, data_dir: Path, shape: dict[str, Any]) -> float:
    """One run of the appliance; returns its wall seconds (from the first admission)."""
    config = load_config(
        overrides={**shape, "data_dir": data_dir, "port": 0, "mode": mode, "eta": eta}, env={}
    )
    async with Appliance(config) as app:
        started = time.perf_counter()
        await app.run()
        return time.perf_counter() - started


def predict(events: list[Event], mode: Mode, eta: int, cost: Any, args: argparse.Namespace) -> SimResult:
    """The simulator's run of the same policy over this run's own rollouts."""
    steps = sum(1 for e in events if isinstance(e, TrainStepCompleted))
    policy = SchedulePolicy(
        batch_groups=args.batch_groups, group_size=args.group_size, max_steps=steps, mode=mode, eta=eta
    )
    rollouts = recorded_rollouts(events, name=mode, prefill_tokens_per_s=cost.prefill_tokens_per_s)
    simulator = Simulator(policy, cost, rollouts, seed=args.seed)
    simulator.run()
    return simulator.result(args.warmup)


def aggregate(
    label: str, measured: list[RunPhases], predictions: dict[str, list[SimResult]]
) -> dict[str, Any]:
    """One mode over its repeats: seconds per step over all their measured steps (each repeat
    weighted by its steps) and where they went, measured and as each prediction has them."""

    def per_step(values: list[tuple[float, int]]) -> float:
        return sum(v * n for v, n in values) / sum(n for _, n in values)

    row: dict[str, Any] = {
        "run": label,
        "steps": sum(m.steps for m in measured),
        "measured": {
            name: per_step([(getattr(m, name), m.steps) for m in measured])
            for name in ("seconds_per_step", "generate", "switch", "train")
        },
        "per_repeat": {"measured": [m.seconds_per_step for m in measured]},
    }
    for name, results in predictions.items():
        parts = [(p, p.breakdown) for p in results if p.breakdown is not None]
        row[name] = {
            "seconds_per_step": per_step([(p.seconds_per_step, p.steps) for p, _ in parts]),
            "generate": per_step([(b.generate, p.steps) for p, b in parts]),
            "switch": per_step([(b.pause, p.steps) for p, b in parts]),
            "train": per_step([(b.train, p.steps) for p, b in parts]),
        }
        row[name]["error"] = row[name]["seconds_per_step"] / row["measured"]["seconds_per_step"] - 1
        row["per_repeat"][name] = [p.seconds_per_step for p in results]
    return row


#: The predictions: from the cost model fitted to every run (the machine's), and from each run's
#: own (the machine as it was during that run: how much of the miss is the model's, how much
#: the load's).
PREDICTIONS = ("predicted", "own_costs")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'run':<8} {'steps':>5} | {'measured':>8} {'gen':>6} {'switch':>6} {'train':>6} | "
        f"{'predicted':>9} {'gen':>6} {'switch':>6} {'train':>6} {'error':>6} | {'own costs':>9} {'error':>6}"
    )
    for r in rows:
        m, p, o = r["measured"], r["predicted"], r["own_costs"]
        print(
            f"{r['run']:<8} {r['steps']:>5} | {m['seconds_per_step']:>8.3f} {m['generate']:>6.3f} "
            f"{m['switch']:>6.3f} {m['train']:>6.3f} | {p['seconds_per_step']:>9.3f} {p['generate']:>6.3f} "
            f"{p['switch']:>6.3f} {p['train']:>6.3f} {p['error']:>+6.1%} | {o['seconds_per_step']:>9.3f} "
            f"{o['error']:>+6.1%}"
        )


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sync's seconds per step over each async run's, measured and as each prediction has it."""
    by_run = {r["run"]: r for r in rows}
    out = []
    for label in [r["run"] for r in rows if r["run"] != "sync"]:
        ratio = {
            name: by_run["sync"][name]["seconds_per_step"] / by_run[label][name]["seconds_per_step"]
            for name in ("measured", *PREDICTIONS)
        }
        out.append(
            {"run": label, **ratio, **{f"{n}_error": ratio[n] / ratio["measured"] - 1 for n in PREDICTIONS}}
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the measurement")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="times each run is made, the modes taking turns (seeds seed, seed+1, ...)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/compare_modes"))
    parser.add_argument(
        "--no-warm-up-run",
        dest="warm_up_run",
        action="store_false",
        help="skip the short run, not measured, made first to warm the process up",
    )
    parser.add_argument("--refit", action="store_true", help="fit and predict from the runs in --out")
    args = parser.parse_args(argv)
    if "sync" not in args.runs:
        parser.error("the runs must include sync (the ratios are over it)")
    walls: dict[str, list[float]] = {label: [] for label in args.runs}
    load = {"before": os.getloadavg()}
    if not args.refit and args.warm_up_run:
        # The first appliance of a process decoded erratically (2 ms to 600 ms a token) in every
        # first run of this script: one short run first, not kept.
        with tempfile.TemporaryDirectory() as scratch:
            asyncio.run(run_appliance("sync", 0, Path(scratch), {**run_shape(args), "max_steps": 2}))
    # The modes take turns, repeat by repeat, so that a busy spell of the machine falls on each
    # alike; repeat r of every mode runs seed + r.
    for r in range(args.repeats):
        for label in args.runs:
            data_dir = args.out / "runs" / f"{label}-{r}"
            if args.refit:
                continue
            if data_dir.exists():
                parser.error(f"{data_dir} exists: remove it, or --refit to use it")
            mode, eta = MODES[label]
            shape = {**run_shape(args), "seed": args.seed + r}
            walls[label].append(asyncio.run(run_appliance(mode, eta, data_dir, shape)))
    load["after"] = os.getloadavg()
    previous = args.out / "compare_modes.json"
    if args.refit and previous.exists():  # the load and wall times of when the runs were made
        made = json.loads(previous.read_text())
        load, walls = made["load_average"], made["wall_s"]
    events = {
        (label, r): [s.event for s in read_events_sync(args.out / "runs" / f"{label}-{r}" / "events.sqlite")]
        for label in args.runs
        for r in range(args.repeats)
    }
    cost = fit_cost(list(events.values()), warmup=args.warmup)
    recorded = [
        recorded_rollouts(run, prefill_tokens_per_s=cost.prefill_tokens_per_s) for run in events.values()
    ]
    workload = describe_rollouts(RecordedRollouts("all", tuple(g for r in recorded for g in r.groups)))
    rows = []
    for label in args.runs:
        runs = [events[label, r] for r in range(args.repeats)]
        mode, eta = MODES[label]
        predictions = {
            "predicted": [predict(run, mode, eta, cost, args) for run in runs],
            "own_costs": [predict(run, mode, eta, fit_cost([run], warmup=args.warmup), args) for run in runs],
        }
        rows.append(aggregate(label, [measure_run(run, args.warmup) for run in runs], predictions))
    print(
        f"{args.model}, {args.batch_groups} groups x {args.group_size} rollouts per step, long-tailed "
        f"agent, {args.steps} steps per run, measured after {args.warmup}, {args.repeats} repeats; load "
        f"average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after"
    )
    print("fitted cost model: " + ", ".join(f"{k}={v:.4g}" for k, v in asdict(cost).items()))
    print("recorded rollouts: " + ", ".join(f"{k}={v:.3g}" for k, v in workload.items()))
    print()
    print_table(rows)
    print()
    for ratio in ratios(rows):
        print(
            f"sync/{ratio['run']}: measured {ratio['measured']:.2f}x, predicted {ratio['predicted']:.2f}x "
            f"({ratio['predicted_error']:+.1%}), own costs {ratio['own_costs']:.2f}x "
            f"({ratio['own_costs_error']:+.1%})"
        )
    result = {
        "shape": run_shape(args),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "wall_s": walls,
        "load_average": load,
        "cost": asdict(cost),
        "rollouts": workload,
        "runs": rows,
        "ratios": ratios(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_modes.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
