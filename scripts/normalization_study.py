"""Rollout- against sample-level loss normalization, side by side in one run.

Trains the same model twice (or once per ``--modes`` entry) with the same seeds, task stream
and budget (steps, tasks per step, rollouts per task), changing only the config
``normalization``. The agent is ``retry_arithmetic.agent_fresh``: a wrong answer gets another
attempt from a fresh prompt, so rollouts make 1 or 2 calls and each call is a sample of its
own. Under ``rollout`` every rollout weighs the same in the loss; under ``sample`` every sample
does, so a rollout that needed the retry (a lower reward, a negative advantage) counts twice as
much as one that was right at once; under ``token`` every sampled token does. Each mode trains
in a fresh process (``--no-subprocess``: all in this one).

Reports for each mode: held-out reward (greedy, 64 sums never trained on) before and after,
first-try accuracy, the policy entropy of the trainer's steps (``TrainStepCompleted.metrics``
``entropy``: first step, last step, mean), calls per rollout, minutes. Writes
``<out>/normalization_study.json`` and ``<out>/normalization_study.png``.

    .venv/bin/python scripts/normalization_study.py [--steps 6] [--model smollm2-135m] [--out DIR]
    # a CPU smoke run (tiny model, which learns nothing; also tests/scripts/test_demo_scripts.py):
    .venv/bin/python scripts/normalization_study.py --model tiny --steps 1 --group-size 2 --batch-groups 1
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import multiprocessing
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from learn_demo import RunResult, fresh_dir, make_config, parser, plot, train_and_evaluate

from harness_adapters.examples import retry_arithmetic


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def table(results: dict[str, RunResult]) -> list[str]:
    """The side-by-side table, as Markdown rows."""
    header = (
        "| normalization | held-out before | held-out after | first try before -> after | "
        "entropy step 1 | entropy last | entropy mean | calls/rollout | samples/rollout | minutes |"
    )
    lines = [header, "|" + "---|" * 10]
    for mode, r in results.items():
        rows = r.rows
        lines.append(
            f"| {mode} | {r.baseline.reward:.3f} | {r.final.reward:.3f} | "
            f"{r.baseline.first_try:.2f} -> {r.final.first_try:.2f} | "
            f"{rows[0].entropy:.3f} | {rows[-1].entropy:.3f} | {mean([x.entropy for x in rows]):.3f} | "
            f"{mean([x.calls_per_rollout for x in rows]):.2f} | "
            f"{mean([x.samples_per_rollout for x in rows]):.2f} | {r.minutes:.1f} |"
            if rows
            else f"| {mode} | {r.baseline.reward:.3f} | - | - | - | - | - | - | - | {r.minutes:.1f} |"
        )
    return lines


def run_mode(args: argparse.Namespace, out: Path, mode: str) -> RunResult:
    """One training run with ``normalization = mode``; held-out before the first and after the
    last step (or every ``--eval-every``), the same evaluation budget for every mode."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _, heldout = retry_arithmetic.addition_split(held_out=args.held_out, seed=args.seed)
    config = make_config(args, out / mode, normalization=mode)
    run = train_and_evaluate(
        config,
        heldout,
        keep_history=False,
        eval_every=args.eval_every or args.steps,
        microbatch_tokens=args.microbatch_tokens,
        log=_log,
    )
    return asyncio.run(run)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.set_defaults(steps=6, out=Path("/tmp/normalization_study"), eval_every=0)
    p.add_argument("--modes", default="rollout,sample", help="comma-separated normalizations to compare")
    p.add_argument(
        "--subprocess",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train each mode in a fresh process (default) or all in this one",
    )
    args = p.parse_args(argv)
    out = fresh_dir(args.out)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(
        f"normalization_study: {args.model}, modes {', '.join(modes)}; each {args.steps} steps x "
        f"{args.batch_groups} tasks x {args.group_size} rollouts, seed {args.seed}, {args.threads} threads",
        flush=True,
    )
    results: dict[str, RunResult] = {}
    for mode in modes:
        print(f"--- normalization = {mode}", flush=True)
        if args.subprocess:
            # A fresh process per mode: the same start for each (memory included; a long run's
            # resident memory grows step by step, see docs/results.md).
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                results[mode] = pool.submit(run_mode, args, out, mode).result()
        else:
            results[mode] = run_mode(args, out, mode)
    lines = table(results)
    print("\n".join(lines), flush=True)
    (out / "normalization_study.json").write_text(
        json.dumps({mode: r.to_json() for mode, r in results.items()} | {"argv": sys.argv}, indent=2)
    )
    plot(
        results,
        out / "normalization_study.png",
        f"{args.model}: loss normalization, retries as samples",
        entropy=True,
    )
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    if "MALLOC_ARENA_MAX" not in os.environ:
        # glibc reads it only at start: restart with it. Without it a long run's resident memory
        # grew ~1 GB per step (malloc arenas of the worker threads); see docs/results.md.
        os.environ["MALLOC_ARENA_MAX"] = "2"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
