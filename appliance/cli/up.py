"""``lightning-appliance up``: run the appliance until it is stopped or reaches ``--steps``.

Owns ``up``'s flags and the config they make, the checks that refuse a start before torch is
imported (the data directory's lock, a port in use, a full disk, a tracker not installed; a
refused start leaves nothing it created, ``common.claim``), the run in front of the dashboard
(stdout a terminal) or with progress lines (``--headless`` or not a terminal), and its exit
status: 0 a stop, 1 a run that could not go on (``EXIT_RUN_FAILED``), 2 a start refused. What
the signals do is ``stopper``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

from appliance.cli.common import (
    claim,
    config_flag,
    config_from_flags,
    engine_flags,
    hard_exit,
    harness_flags,
    loss_text,
    name_env_variables,
    placement_flags,
    reward_text,
    run_async,
)
from appliance.cli.config_flags import add_config_flags, group_by_section
from appliance.cli.logfile import run_log
from appliance.cli.stopper import Stopper
from appliance.config import ApplianceConfig, config_keys


def add_parser(sub: Any) -> None:
    """``up`` and its flags: one for every config field (``config_flags``; those written here
    first), each naming its ``APPLIANCE_*`` variable, grouped by section in ``--help``."""
    up = sub.add_parser("up", help="run the appliance (proxy, engine, scheduler, trainer)")
    config_flag(up)
    up.add_argument("--data-dir", type=Path, help="run directory (default ./appliance-data)")
    up.add_argument("--steps", type=int, dest="max_steps", help="stop when the run reaches this step")
    up.add_argument("--headless", action="store_true", help="print progress lines instead of the dashboard")
    up.add_argument("--host", help="address the proxy binds to (default 127.0.0.1)")
    up.add_argument("--port", type=int, help="proxy port (0: any free port)")
    engine_flags(up)
    harness_flags(up)
    up.add_argument("--group-size", type=int, help="rollouts per task group")
    up.add_argument("--batch-groups", type=int, help="task groups per training step")
    up.add_argument(
        "--mode",
        help="sync (generate a batch, then train) or async (train as soon as a batch is ready; "
        "rollouts under way go on under the new weights)",
    )
    up.add_argument("--eta", type=int, help="async: staleness bound in policy versions (default 1)")
    up.add_argument("--lr", type=float, help="learning rate")
    up.add_argument("--trainer", help="training backend: torch (plain torch) or verl (verl's FSDP engine)")
    up.add_argument(
        "--device",
        help="device of the engine and the trainer: cpu, cuda or auto (default: cuda if torch sees a GPU)",
    )
    up.add_argument(
        "--trainer-ranks",
        type=int,
        help="training processes, one per GPU (more than 1 needs trainer = verl; default: every GPU with "
        "trainer = verl on device = cuda, else 1)",
    )
    up.add_argument("--lora-rank", type=int, help="verl: LoRA rank (0: full fine-tuning)")
    up.add_argument("--lora-alpha", type=int, help="verl: LoRA alpha (default 2 * rank)")
    up.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="verl: recompute activations in the backward pass",
    )
    up.add_argument(
        "--remove-padding",
        action=argparse.BooleanOptionalAction,
        help="verl: pack each micro-batch's sequences without padding (default: on)",
    )
    up.add_argument("--param-dtype", help="verl: bf16, fp16 or fp32 (default: bf16 on cuda, fp32 on cpu)")
    up.add_argument("--kl-coef", type=float, help="verl: KL penalty to the initial policy (0: none)")
    up.add_argument("--kl-type", help="verl: KL estimator (default low_var_kl)")
    up.add_argument("--mini-batches", type=int, help="verl: optimizer steps per training step")
    up.add_argument("--max-tokens-per-microbatch", type=int, help="tokens per trainer micro-batch")
    up.add_argument("--push-bucket-mb", type=int, help="bucket size of the weight push, in MiB")
    up.add_argument(
        "--push-transport",
        help="how pushed weights reach vLLM: files (shared memory), group (broadcast over NCCL/gloo) "
        "or auto (default: group with split placement on GPUs, else files)",
    )
    placement_flags(up)
    up.add_argument("--sleep-level", type=int, help="vLLM's sleep while training: 1 offloads, 2 discards")
    up.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        help="vLLM without CUDA graphs (default: eager on CPU, CUDA graphs on GPU)",
    )
    up.add_argument(
        "--loggers",
        help="experiment trackers, comma-separated: console (default), tensorboard, wandb, mlflow",
    )
    up.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    add_config_flags(up)  # every other field of the config, from its field list
    group_by_section(up)
    name_env_variables(up)


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance up``; a signal after the run stopped changes nothing."""
    try:
        # The lock and the checks that need no model come before torch is imported: a second
        # appliance on the directory, a port in use or a full disk are refused in a second.
        config = _config_from(args, resolved=False)
        from appliance.reporting.trackers import check_backends

        check_backends(config.tracking.loggers)  # a tracker that is not installed: one line
        # A refused start leaves no directory or lock file behind; a started one logs in full
        # to the data directory's appliance.log (the terminal gets one line per failure).
        with claim(config), run_log(config.data_dir):
            return run_async(_up(config.with_resolved_device(), args.headless))
    finally:
        # The run has stopped: a signal from here on (an impatient Ctrl-C) changes nothing.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _config_from(args: argparse.Namespace, *, resolved: bool = True) -> ApplianceConfig:
    """The config of ``up``'s flags (``config_from_flags``): every field has one."""
    keys = [name for name in config_keys() if name != "adapter" and hasattr(args, name)]
    return config_from_flags(args, keys, resolved=resolved)


def progress_line(step: Any, state: Any, started: float, rollouts_at_start: int) -> str:
    """One line per training step for ``--headless``; its reward is ``status``'s
    (``RunState.step_reward``), its loss the step's own (:func:`loss_text`); the step's
    rollouts that failed, with their reasons (``store.outcomes``), when any did."""
    from store.outcomes import failures_text, state_of
    from store.token_figures import step_tokens, tokens_text

    done = sum(1 for v in state.rollouts.values() if v.status != "running") - rollouts_at_start
    rate = done / max(time.monotonic() - started, 1e-9)
    line = (
        f"step {step.step:>4}  policy v{state.policy_version:<4}  "
        f"reward {reward_text(state.step_reward(step))}  rollouts {len(step.rollouts):>3}  "
        f"samples {step.samples:>3}  {tokens_text(step_tokens(step), 5)}  "
        f"loss {loss_text(step.metrics.get('loss'))}  "
        f"{rate:.2f} rollouts/s  step {step.duration_s:.2f}s"
    )
    views = [state.rollouts[r] for r in step.rollouts if r in state.rollouts]
    failed = [view for view in views if state_of(view) == "failed"]
    if failed:
        line += "  " + failures_text(failed)
    if state.validations:  # the latest round that ended (rounds run between steps)
        last = state.validations[-1]
        line += f"  validation {last.reward_mean:.3f} (v{last.policy_version})"
    return line


def _served_as(appliance: Any) -> str:
    """The banner's "served as a, b" when the policy answers to configured names (served_model_names)."""
    names = appliance.served_names
    return "" if names == (appliance.model_name,) else f" served as {', '.join(names)}"


#: Exit status of ``up`` when the run stopped because it could not go on (the circuit breaker
#: gave up after ``breaker_max_trips`` trips in a row); 2 is a start refused, 0 a stop.
EXIT_RUN_FAILED = 1


async def _up(config: ApplianceConfig, headless: bool) -> int:
    from appliance.app import Appliance

    started = time.monotonic()
    baseline: dict[str, int] = {}
    dashboard = not headless and sys.stdout.isatty()

    def on_step(step: Any, state: Any) -> None:
        print(progress_line(step, state, started, baseline.get("rollouts", 0)), flush=True)

    def on_notice(line: str) -> None:
        print(line, flush=True)

    appliance = Appliance(
        config, on_step=None if dashboard else on_step, on_notice=None if dashboard else on_notice
    )
    stopper = Stopper(appliance, config, verbose=not dashboard)
    stopper.install(asyncio.get_running_loop())
    try:
        async with appliance:
            if dashboard:
                reason = await _up_with_dashboard(appliance, config)
            else:
                state = appliance.live.state
                baseline["rollouts"] = sum(1 for v in state.rollouts.values() if v.status != "running")
                print(
                    f"lightning-appliance: proxy {appliance.proxy_url}  model {appliance.model_name}"
                    f"{_served_as(appliance)}  "
                    f"store {config.db_path}  policy v{state.policy_version}  step {state.step}",
                    flush=True,
                )
                print(f"lightning-appliance: {appliance.isolation.line}", flush=True)
                if appliance.tracker is not None:
                    print(f"lightning-appliance: {appliance.tracker.describe()}", flush=True)
                reason = await appliance.run()
    finally:
        stopper.close()
    # A stop forced while closing (a second signal) is recorded as such; say what was recorded.
    reason = appliance.stop_reason if appliance.forced is not None else reason
    print(f"stopped: {reason}", flush=True)
    if appliance.forced is not None:
        # A step abandoned by a forced stop may still run in a worker thread, which the event
        # loop's shutdown would wait for; everything durable is closed already.
        hard_exit(0)
    # The run could not go on (the circuit breaker gave up): the line above names the last failure.
    return EXIT_RUN_FAILED if appliance.failed else 0


async def _up_with_dashboard(appliance: Any, config: ApplianceConfig) -> str:
    """Run the appliance with the dashboard in front; quitting the dashboard stops the run, and
    a run that stops on a signal closes the dashboard. Returns why the run stopped."""
    from tui.app import DashboardApp
    from tui.source import ControlClient, SqliteSource

    app = DashboardApp(
        SqliteSource(config.db_path, live=True, label=f"{appliance.proxy_url}  {config.db_path}"),
        control=ControlClient(appliance.proxy_url, appliance.admin_token),
        data_dir=config.data_dir,
    )
    run = asyncio.create_task(appliance.run(), name="appliance run")

    def ended(task: asyncio.Task[str]) -> None:
        if not app.is_running or task.cancelled() or task.exception() is not None:
            return
        if appliance.stop_requested:
            app.exit()
        else:
            app.notify(f"the run stopped: {task.result()}; press q to quit", timeout=30)

    run.add_done_callback(ended)
    await app.run_async()
    if not run.done():
        print("stopping: the run finishes what it is doing ...", flush=True)
        appliance.request_stop()
    reason: str = await run
    return reason
