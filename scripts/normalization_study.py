"""Rollout- against sample-level loss normalization, over several seeds.

Trains the same model once per ``--modes`` entry and ``--seeds`` entry (default: rollout and
sample, seeds 0, 1, 2: six runs), changing only the config ``normalization`` between modes;
runs of one seed share the weights, the task stream and the sampling seeds. The agent
(``--agent fresh4``, ``harness_adapters/examples/four_attempts.py``) asks "What is a + b? Reply
with only the number." and after a wrong answer tries again from a fresh prompt, up to four
attempts (reward 1, 0.5, 0.25, 0.125 or 0), so rollouts make 1 to 4 calls and each call is a
sample of its own. Under ``rollout`` every rollout weighs the same in the loss; under ``sample``
every sample does, so a rollout that needed retries (a lower reward, a negative advantage)
counts as often as it called; under ``token`` every sampled token does. Advantages have no such
switch in the config (``[trainer] advantage`` picks the estimator, GRPO by default): they are
always computed per rollout and broadcast to every sample of it.

Held out: the same 64 of the 100 single-digit sums for every seed and mode (``--split-seed``),
never trained on, nothing tuned on them; scored greedily (temperature 0, the same agent's
episode) before the first step, every ``--eval-every`` steps and after the last, while the
next training rollouts wait. Per step: held-out reward (where scored) and the policy entropy
of the trainer's step (``TrainStepCompleted.metrics["entropy"]``), as mean and spread
(std, min-max) over the seeds.

Writes ``<out>/normalization_study.json`` (every run, every step, the spreads),
``<out>/normalization_study.png`` (held-out reward and entropy per step: mean over seeds,
min-max shaded) and ``<out>/normalization_study.md`` (the tables); prints the tables.

Wall time, measured with smollm2-135m on 2 shared CPU cores (docs/results.md): 57-82 s per
training step, 29-79 s per held-out evaluation, about 1 min to load; the default (2 modes x 3
seeds x 10 steps, 6 evaluations each) takes about 1 to 2.5 hours. Run it in the background:

    nohup nice .venv/bin/python scripts/normalization_study.py --out /tmp/normalization_study \\
        > /tmp/normalization_study.log 2>&1 &
    # a CPU smoke run (tiny model, which learns nothing; also tests/scripts/test_demo_scripts.py):
    .venv/bin/python scripts/normalization_study.py --model tiny --steps 1 --group-size 2 \\
        --batch-groups 1 --held-out 4 --seeds 0
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

from learn_demo import (
    AGENTS,
    RunResult,
    args_json,
    log_line,
    make_config,
    run_script,
    run_study,
    study_parser,
    train_and_evaluate,
    write_tables,
)
from seed_spread import Panel, Spread, by_step, plot_panels, spread, write_json

from harness_adapters.examples import retry_arithmetic

#: Results of a study: mode -> seed -> run.
Runs = dict[str, dict[int, RunResult]]


def heldout_by_step(run: RunResult) -> dict[int, float]:
    """Held-out reward at step 0 (before training) and at every scored step."""
    return {0: run.baseline.reward} | {r.step: r.heldout.reward for r in run.rows if r.heldout is not None}


def per_step(runs: Runs) -> dict[str, dict[str, dict[int, Spread]]]:
    """mode -> figure ("heldout", "entropy", "train_reward") -> step -> spread over seeds."""
    return {
        mode: {
            "heldout": by_step([heldout_by_step(r) for r in seeds.values()]),
            "entropy": by_step([{row.step: row.entropy for row in r.rows} for r in seeds.values()]),
            "train_reward": by_step([{row.step: row.train_reward for row in r.rows} for r in seeds.values()]),
        }
        for mode, seeds in runs.items()
    }


def summary(runs: Runs) -> dict[str, dict[str, Spread]]:
    """mode -> figure -> spread over seeds of the run's figure (final = last scored step)."""
    out: dict[str, dict[str, Spread]] = {}
    for mode, seeds in runs.items():
        rs = list(seeds.values())
        out[mode] = {
            "heldout_before": spread(r.baseline.reward for r in rs),
            "heldout_after": spread(r.final.reward for r in rs),
            "first_try_after": spread(r.final.first_try for r in rs),
            "entropy_first": spread(r.rows[0].entropy for r in rs if r.rows),
            "entropy_last": spread(r.rows[-1].entropy for r in rs if r.rows),
            "entropy_mean": spread(spread(x.entropy for x in r.rows).mean for r in rs),
            "samples_per_rollout": spread(spread(x.samples_per_rollout for x in r.rows).mean for r in rs),
            "minutes": spread(r.minutes for r in rs),
        }
    return out


def tables(runs: Runs) -> list[str]:
    """The Markdown tables: one row per mode (mean ± std [min, max] over seeds), then per step."""
    columns = list(next(iter(summary(runs).values()), {}))
    lines = ["| normalization | " + " | ".join(c.replace("_", " ") for c in columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for mode, figures in summary(runs).items():
        lines.append(f"| {mode} | " + " | ".join(str(figures[c]) for c in columns) + " |")
    steps = per_step(runs)
    lines += ["", "| step | " + " | ".join(f"{m}: held-out | {m}: entropy" for m in steps) + " |"]
    lines.append("|---:|" + "---:|---:|" * len(steps))
    all_steps = sorted({s for figures in steps.values() for f in figures.values() for s in f})
    for step in all_steps:
        cells = [
            f"{figures['heldout'].get(step, '')} | {figures['entropy'].get(step, '')}"
            for figures in steps.values()
        ]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def run_one(args: argparse.Namespace, out: Path, mode: str, seed: int) -> RunResult:
    """One training run with ``normalization = mode`` and ``seed``; held-out before the first
    and after the last step and every ``--eval-every``, the same evaluations for every run."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = argparse.Namespace(**vars(args) | {"seed": seed})
    _, heldout = retry_arithmetic.addition_split(held_out=args.held_out, seed=args.split_seed)
    config = make_config(args, out / f"{mode}-seed{seed}", normalization=mode)
    run = train_and_evaluate(
        config,
        heldout,
        agent=AGENTS[args.agent],
        eval_every=args.eval_every or args.steps,
        microbatch_tokens=args.microbatch_tokens,
        log=log_line,
    )
    return asyncio.run(run)


def main(argv: Sequence[str] | None = None) -> int:
    p = study_parser(
        __doc__.split("\n\n")[0], modes="rollout,sample", out=Path("/tmp/normalization_study"), agent="fresh4"
    )
    args = p.parse_args(argv)
    out, runs = run_study("normalization_study", args, run_one)
    write_tables(out / "normalization_study.md", tables(runs))
    steps = per_step(runs)
    write_json(out / "normalization_study.json", args_json(args), runs, summary=summary(runs), per_step=steps)
    plot_panels(
        out / "normalization_study.png",
        f"{args.model}, agent {args.agent}: loss normalization, {len(args.seeds)} seeds (mean, min-max)",
        [
            Panel(
                "training step",
                f"held-out reward (greedy, {args.held_out} sums)",
                {mode: figures["heldout"] for mode, figures in steps.items()},
                ylim=(0, 1),
            ),
            Panel(
                "training step",
                "policy entropy (mean over sampled tokens)",
                {mode: figures["entropy"] for mode, figures in steps.items()},
            ),
        ],
    )
    return 0


if __name__ == "__main__":
    run_script(main)
