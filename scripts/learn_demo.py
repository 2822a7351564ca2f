"""It learns: train a real small model on CPU on a multi-turn task, held-out reward before and after.

Runs the whole appliance in process (proxy, torch engine, scheduler, torch or verl trainer) on
``smollm2-135m`` with the multi-turn agent ``harness_adapters/examples/retry_arithmetic.py``:
the agent uses the official ``openai`` client against its rollout's base URL, answers
"What is a + b?", and after "wrong" tries once more (1 or 2 calls; reward 1, 0.5 or 0).
Training draws from 36 of the 100 single-digit sums; the other 64 are held out and scored
greedily (temperature 0) through the proxy's plain ``/v1`` with the admin token before the
first step, every ``--eval-every`` steps and after the last one, while training rollouts wait.

``--agent`` picks another episode (``AGENTS``: the fresh-prompt retry, or up to four
fresh-prompt attempts); ``--seed`` changes the task stream, ``--split-seed`` which sums are
held out. The study scripts (``normalization_study.py``, ``async_vs_sync.py``) build on this
module's config, run loop, options and helpers.

Prints one line per step and a summary (baseline and final held-out reward, minutes, steps);
writes ``<out>/learn_demo.json`` and a plot of reward vs step (train and held-out) to
``<out>/learn_demo.png``. Figures from a real run are in docs/results.md. Wall time with the
defaults: about 16 minutes on 2 CPU cores (10 steps, three evaluations, model loading).

    .venv/bin/python scripts/learn_demo.py [--steps 10] [--model smollm2-135m] [--out /tmp/learn_demo]
    # a CPU smoke run (tiny model, which learns nothing; also tests/scripts/test_demo_scripts.py):
    .venv/bin/python scripts/learn_demo.py --model tiny --steps 1 --group-size 2 --batch-groups 1
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from appliance.app import Appliance
from appliance.config import ApplianceConfig, load_config
from appliance.engines.models import resolve
from harness_adapters.base import ClientConfig, Task
from harness_adapters.examples import four_attempts, retry_arithmetic
from harness_adapters.examples.heldout import Evaluation, HeldBackAdapter, evaluate
from harness_adapters.python import PythonAdapter
from store.events import TrainStepCompleted
from store.projections import RunState

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AgentChoice:
    """How a run's rollouts are played, and the same episode for scoring held-out tasks."""

    agent: Callable[[Task, ClientConfig], Awaitable[float]]
    #: The retry continues the conversation (one merged sample per rollout) or starts from a
    #: fresh prompt (one sample per call).
    keep_history: bool
    attempts: int


#: The agents ``--agent`` names: the conversation task of docs/results.md, its fresh-prompt
#: variant, and the fresh-prompt variant with up to four attempts (1 to 4 samples per rollout).
AGENTS = {
    "conversation": AgentChoice(retry_arithmetic.agent, True, retry_arithmetic.ATTEMPTS),
    "fresh": AgentChoice(retry_arithmetic.agent_fresh, False, retry_arithmetic.ATTEMPTS),
    "fresh4": AgentChoice(four_attempts.agent, False, four_attempts.ATTEMPTS),
}


@dataclass(slots=True)
class StepRow:
    """One training step: what the trainer saw (sampled at temperature 1) and, when scored, held-out."""

    step: int
    minutes: float
    train_reward: float
    entropy: float
    loss: float
    calls_per_rollout: float
    samples_per_rollout: float
    seconds: float
    #: Resident memory of this process after the step, in GB.
    rss_gb: float = 0.0
    heldout: Evaluation | None = None


@dataclass(slots=True)
class RunResult:
    baseline: Evaluation
    rows: list[StepRow] = field(default_factory=list)
    minutes: float = 0.0
    reason: str = ""

    @property
    def final(self) -> Evaluation:
        scored = [row.heldout for row in self.rows if row.heldout is not None]
        return scored[-1] if scored else self.baseline

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"final": dataclasses.asdict(self.final)}


def parser(description: str) -> argparse.ArgumentParser:
    """The options every learning script takes."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', 'tiny' or a model directory")
    p.add_argument("--models-dir", type=Path, default=Path("appliance-data/models"), help="converted models")
    p.add_argument("--out", type=Path, default=Path("/tmp/learn_demo"), help="run directory (must be new)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task (GRPO group)")
    p.add_argument("--batch-groups", type=int, default=4, help="tasks per step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--eval-every", type=int, default=5, help="score held-out tasks every N steps")
    p.add_argument("--held-out", type=int, default=retry_arithmetic.HELD_OUT, help="sums held out (of 100)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--trainer", default="torch", choices=("torch", "verl"))
    p.add_argument("--agent", default="conversation", choices=sorted(AGENTS), help="the rollouts' agent")
    p.add_argument("--seed", type=int, default=0, help="training seed: task stream (and the tiny model)")
    p.add_argument(
        "--split-seed", type=int, default=0, help="which sums are held out (the same for every --seed)"
    )
    p.add_argument(
        "--microbatch-tokens", type=int, default=1024, help="torch trainer: tokens per micro-batch (memory)"
    )
    return p


def make_config(args: argparse.Namespace, data_dir: Path, **overrides: Any) -> ApplianceConfig:
    """The run's config: the task split on disk, no forced temperature (the agent asks for 1.0,
    the held-out evaluation for 0), room for a whole held-out set in one engine batch;
    ``overrides`` are more config keys (``normalization``, ``mode``, ``validate_every``, ...)."""
    model = resolve(args.model, args.models_dir, seed=args.seed)
    tasks = retry_arithmetic.write_taskset(
        data_dir / "tasks.jsonl", held_out=args.held_out, seed=args.split_seed
    )
    config = load_config(
        overrides={
            "data_dir": data_dir,
            "port": 0,
            "model": str(model.path),
            "tasks": tasks,
            "task_split": "train",
            "group_size": args.group_size,
            "batch_groups": args.batch_groups,
            "max_steps": args.steps,
            "lr": args.lr,
            "max_tokens": retry_arithmetic.MAX_TOKENS,
            "max_batch_size": max(64, args.group_size * args.batch_groups),
            "threads": args.threads,
            "trainer": args.trainer,
            "seed": args.seed,
            # The held-out score here replaces the appliance's own validation rounds.
            "validate_every": 0,
            # Held-back rollouts wait for the evaluation; that wait is not the agent's time.
            "rollout_timeout_s": 3600.0,
        }
        | overrides,
        env={},
    )
    return config.replace(temperature=None)


def rss_gb() -> float:
    """This process's resident memory now (Linux), in GB; 0.0 where /proc is not there."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


def fmt_eval(ev: Evaluation) -> str:
    return (
        f"held-out {ev.reward:.3f} (first try {ev.first_try:.2f}, solved {ev.solved:.2f}, "
        f"calls {ev.calls:.2f})"
    )


def fmt_row(row: StepRow) -> str:
    line = (
        f"step {row.step:>3}  {row.minutes:6.1f} min  train reward {row.train_reward:.3f}  "
        f"calls/rollout {row.calls_per_rollout:.2f}  entropy {row.entropy:.3f}  loss {row.loss:+.4f}  "
        f"step {row.seconds:5.1f} s  rss {row.rss_gb:.1f} GB"
    )
    return line + ("" if row.heldout is None else "  " + fmt_eval(row.heldout))


async def train_and_evaluate(
    config: ApplianceConfig,
    heldout: Sequence[Task],
    *,
    agent: AgentChoice = AGENTS["conversation"],
    eval_every: int = 1,
    microbatch_tokens: int | None = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Baseline held-out score, then ``config.max_steps`` steps, scoring every ``eval_every``."""
    adapter = HeldBackAdapter(PythonAdapter(agent.agent))
    started = time.monotonic()
    pending: list[asyncio.Task[None]] = []
    result: RunResult | None = None

    async def score() -> Evaluation:
        return await evaluate(
            app.proxy_url,
            app.admin_token,
            app.model_name,
            heldout,
            keep_history=agent.keep_history,
            attempts=agent.attempts,
        )

    async def score_row(row: StepRow) -> None:
        try:
            row.heldout = await score()
        finally:
            adapter.release()
        log(fmt_row(row))

    def on_step(step: TrainStepCompleted, state: RunState) -> None:
        views = [state.rollouts[r] for r in step.rollouts if r in state.rollouts]
        calls = sum(v.call_count for v in views) / max(len(views), 1)
        metrics = step.metrics
        row = StepRow(
            step=step.step,
            minutes=(time.monotonic() - started) / 60,
            train_reward=metrics.get("reward_mean", 0.0),
            entropy=metrics.get("entropy", float("nan")),
            loss=metrics.get("loss", float("nan")),
            calls_per_rollout=calls,
            samples_per_rollout=metrics.get("samples_per_rollout", float("nan")),
            seconds=step.duration_s,
            rss_gb=rss_gb(),
        )
        assert result is not None
        result.rows.append(row)
        if step.step % eval_every == 0 or step.step == config.scheduler.max_steps:
            adapter.hold()  # before the scheduler admits the next groups
            pending.append(asyncio.ensure_future(score_row(row)))
        else:
            log(fmt_row(row))

    async with Appliance(config, adapter=adapter, on_step=on_step) as app:
        trainer = app.training.trainer
        if microbatch_tokens and hasattr(trainer, "max_tokens_per_microbatch"):
            # The logits of 4096 tokens x a 49k vocabulary take GBs: two runs at once on this
            # machine were OOM-killed at the default. Gradients add up over micro-batches.
            trainer.max_tokens_per_microbatch = microbatch_tokens
        log(f"{app.model_name}: proxy {app.proxy_url}, {len(heldout)} held-out tasks, store {config.db_path}")
        result = RunResult(baseline=await score())
        log(f"step   0  {(time.monotonic() - started) / 60:6.1f} min  baseline {fmt_eval(result.baseline)}")
        result.reason = await app.run()
        await asyncio.gather(*pending)
    result.minutes = (time.monotonic() - started) / 60
    return result


def plot(result: RunResult, path: Path, title: str) -> None:
    """Reward vs step: the training batches' mean reward (sampled) and held-out (greedy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r.step for r in result.rows]
    train = [r.train_reward for r in result.rows]
    ax.plot(steps, train, color="tab:blue", alpha=0.5, ls="--", marker=".", label="train (sampled, T=1)")
    scored = [(0, result.baseline)] + [(r.step, r.heldout) for r in result.rows if r.heldout is not None]
    held = f"held-out (greedy, {result.baseline.tasks} tasks)"
    ax.plot([s for s, _ in scored], [e.reward for _, e in scored], color="tab:blue", marker="o", label=held)
    ax.set(xlabel="training step", ylabel="mean reward", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def in_fresh_process(fn: Callable[..., T], *args: Any, fresh: bool = True) -> T:
    """``fn(*args)`` in a fresh (spawned) process, or in this one when not ``fresh``. A fresh
    process per run gives every run the same start, memory included (a long run's resident
    memory grows step by step, see docs/results.md)."""
    if not fresh:
        return fn(*args)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def study_parser(description: str, *, modes: str, **defaults: Any) -> argparse.ArgumentParser:
    """The options of a study over modes and seeds: ``parser``'s (with ``defaults``), plus
    ``--modes`` (default ``modes``), ``--seeds`` and ``--subprocess``."""
    p = parser(description)
    p.set_defaults(steps=10, eval_every=2, **defaults)
    p.add_argument("--modes", default=modes, help="comma-separated modes to compare")
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="training seeds, e.g. 0,1,2")
    p.add_argument(
        "--subprocess",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train each run in a fresh process (default) or all in this one",
    )
    return p


def runs_from_option(p: argparse.ArgumentParser) -> None:
    """``--runs-from DIR``, for a study that reads its finished runs back (``run_study``'s
    ``read_back``)."""
    p.add_argument(
        "--runs-from",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="an earlier --out of the same study: its finished runs of a mode and seed are read "
        "back from their event logs instead of run again (repeatable; a study cut short goes on)",
    )


def run_study(
    name: str,
    args: argparse.Namespace,
    run_one: Callable[[argparse.Namespace, Path, str, int], T],
    read_back: Callable[[argparse.Namespace, Path, str, int], T | None] | None = None,
) -> tuple[Path, dict[str, dict[int, T]]]:
    """Every ``run_one(args, out, mode, seed)`` of a study, in ``fresh_dir(args.out)``; returns
    the directory and mode -> seed -> result. Seed by seed, the modes of a seed next to each
    other, so a study stopped early still compares. With ``read_back``, a run that it finds
    finished in one of ``args.runs_from`` (``read_back(args, directory, mode, seed)``: None when
    not there or not finished) is taken from there instead."""
    out = fresh_dir(args.out)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    log_line(
        f"{name}: {args.model}, agent {args.agent}, modes {', '.join(modes)}, seeds {args.seeds}; each "
        f"{args.steps} steps x {args.batch_groups} tasks x {args.group_size} rollouts, held-out every "
        f"{args.eval_every} steps, lr {args.lr:g}, {args.threads} threads"
    )
    runs: dict[str, dict[int, T]] = {mode: {} for mode in modes}
    for seed in args.seeds:
        for mode in modes:
            earlier = _earlier_run(args, mode, seed, read_back)
            if earlier is not None:
                log_line(f"--- {name}: {mode}, seed {seed}: read back from {earlier[0]}")
                runs[mode][seed] = earlier[1]
                continue
            log_line(f"--- {name}: {mode}, seed {seed}")
            runs[mode][seed] = in_fresh_process(run_one, args, out, mode, seed, fresh=args.subprocess)
    return out, runs


def _earlier_run(
    args: argparse.Namespace,
    mode: str,
    seed: int,
    read_back: Callable[[argparse.Namespace, Path, str, int], T | None] | None,
) -> tuple[Path, T] | None:
    """The first of ``args.runs_from`` that holds a finished run of ``mode`` and ``seed``, and it."""
    if read_back is None:
        return None
    for directory in getattr(args, "runs_from", ()):
        found = read_back(args, directory, mode, seed)
        if found is not None:
            return directory, found
    return None


def write_tables(path: Path, lines: Sequence[str]) -> None:
    """Print a study's Markdown tables and write them to ``path``."""
    log_line("\n".join(lines))
    path.write_text("\n".join(lines) + "\n")


def seed_list(text: str) -> list[int]:
    """``--seeds``: comma-separated integers, e.g. "0,1,2"."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers; got {text!r}") from None


def fresh_dir(path: Path) -> Path:
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"{path} is not empty: pass a new --out (a run there would resume)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    out = fresh_dir(args.out)
    config = make_config(args, out / "run")
    _, heldout = retry_arithmetic.addition_split(held_out=args.held_out, seed=args.split_seed)
    print(
        f"learn_demo: {args.model}, {args.steps} steps x {args.batch_groups} tasks x {args.group_size} "
        f"rollouts, lr {args.lr:g}, trainer {args.trainer}, {os.cpu_count()} CPUs, {args.threads} threads",
        flush=True,
    )
    result = asyncio.run(
        train_and_evaluate(
            config,
            heldout,
            agent=AGENTS[args.agent],
            eval_every=args.eval_every,
            microbatch_tokens=args.microbatch_tokens,
            log=log_line,
        )
    )
    (out / "learn_demo.json").write_text(json.dumps(result.to_json() | {"args": args_json(args)}, indent=2))
    plot(result, out / "learn_demo.png", f"{args.model} on CPU: multi-turn a + b, retries")
    print(
        f"summary: held-out reward {result.baseline.reward:.3f} -> {result.final.reward:.3f} "
        f"(first try {result.baseline.first_try:.2f} -> {result.final.first_try:.2f}) over "
        f"{len(result.rows)} steps in {result.minutes:.1f} min ({result.reason}); "
        f"plot {out / 'learn_demo.png'}",
        flush=True,
    )
    return 0


def log_line(line: str) -> None:
    print(line, flush=True)


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "argv": sys.argv,
        "cpus": os.cpu_count(),
    }


def run_script(main: Callable[[], int]) -> None:
    """Run a script's ``main`` with ``MALLOC_ARENA_MAX=2``, restarting the process once to set it:
    glibc reads it only at start. Without it a long run's resident memory grew ~1 GB per step
    (malloc arenas of the worker threads); see docs/results.md."""
    if "MALLOC_ARENA_MAX" not in os.environ:
        os.environ["MALLOC_ARENA_MAX"] = "2"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())


if __name__ == "__main__":
    run_script(main)
