"""The ``lightning-appliance`` command line.

Owns argument parsing, the event loop (uvloop when available), signal handling, progress lines
and the ``status`` report. ``up`` runs the appliance until it is stopped or reaches ``--steps``
(the run's total: a restarted run continues to the same target), showing the dashboard (``tui``)
when stdout is a terminal and progress lines otherwise or with ``--headless``; ``status`` reads
the store and prints the run summarised, also while another process is writing it; ``tui``
opens the dashboard on a running appliance (``--url``) or on a run's store, read-only (``--db``).
Errors a person can fix are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config import ApplianceConfig, load_config
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    from tui.app import DashboardApp


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-appliance", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the appliance (proxy, engine, scheduler, trainer)")
    up.add_argument("--config", type=Path, help="TOML file with config keys (see appliance/config.py)")
    up.add_argument("--data-dir", type=Path, help="run directory (default ./appliance-data)")
    up.add_argument("--steps", type=int, dest="max_steps", help="stop when the run reaches this step")
    up.add_argument("--headless", action="store_true", help="print progress lines instead of the dashboard")
    up.add_argument("--host", help="address the proxy binds to (default 127.0.0.1)")
    up.add_argument("--port", type=int, help="proxy port (0: any free port)")
    up.add_argument("--model", help="'tiny', 'smollm2-135m', or a local Hugging Face model directory")
    up.add_argument("--engine", help="generation engine: torch (in process) or vllm (own process and venv)")
    up.add_argument("--agent", help="python agent as package.module:function")
    up.add_argument("--group-size", type=int, help="rollouts per task group")
    up.add_argument("--batch-groups", type=int, help="task groups per training step")
    up.add_argument("--lr", type=float, help="learning rate")
    up.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")

    status = sub.add_parser("status", help="print the state of a run from its store")
    status.add_argument("--data-dir", type=Path, default=Path("appliance-data"))
    status.add_argument("--json", action="store_true", help="print JSON instead of text")

    tui = sub.add_parser("tui", help="the dashboard: on a running appliance, or a run's store read-only")
    where = tui.add_mutually_exclusive_group()
    where.add_argument("--db", type=Path, help="a run's events.sqlite, opened read-only (controls off)")
    where.add_argument("--url", help="a running appliance's proxy URL, e.g. http://127.0.0.1:8640")
    tui.add_argument("--token", help="admin token for --url (default: <data-dir>/admin_token)")
    tui.add_argument(
        "--data-dir",
        type=Path,
        default=Path("appliance-data"),
        help="run directory (default ./appliance-data)",
    )
    return parser


def _config_from(args: argparse.Namespace) -> ApplianceConfig:
    keys = (
        "data_dir",
        "max_steps",
        "host",
        "port",
        "model",
        "engine",
        "agent",
        "group_size",
        "batch_groups",
        "lr",
    )
    return load_config(args.config, {k: getattr(args, k) for k in keys})


def progress_line(step: Any, state: Any, started: float, rollouts_at_start: int) -> str:
    """One line per training step for ``--headless``."""
    metrics = step.metrics
    done = sum(1 for v in state.rollouts.values() if v.status != "running") - rollouts_at_start
    rate = done / max(time.monotonic() - started, 1e-9)
    line = (
        f"step {step.step:>4}  policy v{state.policy_version:<4}  "
        f"reward {metrics.get('reward_mean', 0.0):.3f}  rollouts {len(step.rollouts):>3}  "
        f"samples {step.samples:>3}  tokens {step.tokens:>5}  loss {metrics.get('loss', 0.0):+.4f}  "
        f"{rate:.2f} rollouts/s  step {step.duration_s:.2f}s"
    )
    if state.validations:  # the latest round that ended (rounds run between steps)
        last = state.validations[-1]
        line += f"  validation {last.reward_mean:.3f} (v{last.policy_version})"
    return line


async def _up(config: ApplianceConfig, headless: bool) -> int:
    from appliance.app import Appliance

    started = time.monotonic()
    baseline: dict[str, int] = {}
    dashboard = not headless and sys.stdout.isatty()

    def on_step(step: Any, state: Any) -> None:
        print(progress_line(step, state, started, baseline.get("rollouts", 0)), flush=True)

    appliance = Appliance(config, on_step=None if dashboard else on_step)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, appliance.request_stop)
    async with appliance:
        if dashboard:
            return await _up_with_dashboard(appliance, config)
        state = appliance.live.state
        baseline["rollouts"] = sum(1 for v in state.rollouts.values() if v.status != "running")
        print(
            f"lightning-appliance: proxy {appliance.proxy_url}  model {appliance.model_name}  "
            f"store {config.db_path}  policy v{state.policy_version}  step {state.step}",
            flush=True,
        )
        reason = await appliance.run()
    print(f"stopped: {reason}", flush=True)
    return 0


async def _up_with_dashboard(appliance: Any, config: ApplianceConfig) -> int:
    """Run the appliance with the dashboard in front; quitting the dashboard stops the run."""
    from tui.app import DashboardApp
    from tui.source import ControlClient, SqliteSource

    app = DashboardApp(
        SqliteSource(config.db_path, live=True, label=f"{appliance.proxy_url}  {config.db_path}"),
        control=ControlClient(appliance.proxy_url, appliance.admin_token),
        data_dir=config.data_dir,
    )
    run = asyncio.create_task(appliance.run(), name="appliance run")

    def ended(task: asyncio.Task[str]) -> None:
        if app.is_running and not task.cancelled() and task.exception() is None:
            app.notify(f"the run stopped: {task.result()}; press q to quit", timeout=30)

    run.add_done_callback(ended)
    await app.run_async()
    if not run.done():
        print("stopping: the run finishes what it is doing ...", flush=True)
        appliance.request_stop()
    reason = await run
    print(f"stopped: {reason}", flush=True)
    return 0


def tui_app(args: argparse.Namespace) -> DashboardApp:
    """The dashboard ``lightning-appliance tui`` shows, built from its flags."""
    from tui.app import DashboardApp
    from tui.source import ControlClient, HttpSource, SqliteSource

    data_dir: Path = args.data_dir
    if args.url:
        token = args.token or os.environ.get("APPLIANCE_ADMIN_TOKEN")
        token_file = data_dir / "admin_token"
        if not token and token_file.is_file():
            token = token_file.read_text().strip()
        if not token:
            raise ApplianceError(
                f"--url needs the admin token: pass --token or run where {token_file} exists"
            )
        return DashboardApp(
            HttpSource(args.url, token),
            control=ControlClient(args.url, token),
            data_dir=data_dir,
            freeze_gc=True,
        )
    db: Path = args.db or data_dir / "events.sqlite"
    if not db.is_file():
        raise ApplianceError(f"no event store at {db}; pass --db FILE or --url URL")
    return DashboardApp(SqliteSource(db, live=False), data_dir=db.parent, freeze_gc=True)


def status_report(data_dir: Path) -> dict[str, Any]:
    from store.eventstore import read_events_sync
    from store.projections import RunState

    db = data_dir / "events.sqlite"
    if not db.is_file():
        raise ApplianceError(f"no run at {data_dir} (no {db.name}); start one with: lightning-appliance up")
    state = RunState.from_events(read_events_sync(db))
    summary = state.summary()
    summary["steps_detail"] = [
        {
            "step": s.step,
            "rollouts": len(s.rollouts),
            "samples": s.samples,
            "tokens": s.tokens,
            "reward_mean": s.metrics.get("reward_mean"),
            "loss": s.metrics.get("loss"),
        }
        for s in state.steps
    ]
    summary["events"] = state.position
    summary["starts"] = state.starts
    summary["checkpoint"] = state.checkpoint
    summary["chain"] = _chain_status(db)
    summary["validations"] = [
        {
            "step": v.step,
            "policy_version": v.policy_version,
            "rollouts": len(v.rollouts),
            "failed": v.failed,
            "reward_mean": v.reward_mean,
            "reward_std": v.reward_std,
        }
        for v in state.validations
    ]
    return summary


def _chain_status(db: Path) -> str:
    """Whether the log's checksum chain holds (status reports a broken one, it does not fail)."""
    from appliance.errors import StoreError
    from store.eventstore import verify_log

    try:
        return f"verified ({verify_log(db).events} events)"
    except StoreError as exc:
        return f"NOT verified: {exc.message}"


def _print_status(summary: dict[str, Any]) -> None:
    counts = summary["rollouts"]
    reward = summary["mean_reward"]
    print(f"run {summary['run_id'] or '-'}  phase {summary['phase']}  starts {summary['starts']}")
    print(
        f"policy v{summary['policy_version']}  step {summary['step']}  "
        f"checkpoint {summary['checkpoint'] or '-'}  events {summary['events']}"
    )
    print(f"checksum chain {summary['chain']}")
    print(
        "rollouts " + "  ".join(f"{k} {v}" for k, v in counts.items()) + f"  calls {summary['calls']}  "
        f"tokens sampled {summary['tokens_sampled']}"
    )
    print("last step mean reward " + ("-" if reward is None else f"{reward:.3f}"))
    for s in summary["steps_detail"]:
        print(
            f"  step {s['step']:>4}  rollouts {s['rollouts']:>3}  samples {s['samples']:>3}  "
            f"tokens {s['tokens']:>5}  reward {s['reward_mean'] or 0:.3f}  loss {s['loss'] or 0:+.4f}"
        )
    for v in summary["validations"]:
        print(
            f"  validation at step {v['step']:>4}  policy v{v['policy_version']}  "
            f"rollouts {v['rollouts']:>3}  failed {v['failed']}  "
            f"reward {v['reward_mean']:.3f} +- {v['reward_std']:.3f}"
        )


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Model loading progress bars would drown the progress lines.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "status":
            summary = status_report(args.data_dir)
            if args.json:
                print(json.dumps(summary, indent=2))
            else:
                _print_status(summary)
            return 0
        if args.command == "tui":
            tui_app(args).run()
            return 0
        return _run(_up(_config_from(args), args.headless))
    except ApplianceError as exc:
        print(f"lightning-appliance: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
