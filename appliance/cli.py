"""The ``lightning-appliance`` command line.

Owns argument parsing, the event loop (uvloop when available), signal handling, progress lines
and the ``status`` report. ``up`` runs the appliance until it is stopped or reaches ``--steps``
(the run's total: a restarted run continues to the same target), showing the dashboard (``tui``)
when stdout is a terminal and progress lines otherwise or with ``--headless``; ``status`` reads
the store and prints the run summarised (with the disk it takes), also while another process
is writing it; ``tui`` opens the dashboard on a running appliance (``--url``) or on a run's
store, read-only (``--db``); ``backup`` copies a run, also a running one (``appliance.backup``);
``export`` writes its recorded rollouts as a dataset file (``appliance.dataset_export``);
``plan`` prints the GPU placement of a model on this machine or a described one
(``appliance.placement``), exit status 2 when it does not fit;
``doctor`` tells what this machine offers a run and what to fix (``appliance.doctor``).
Errors a person can fix are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec

from appliance import preflight
from appliance.config import ENV_PREFIX, VERL_ONLY, ApplianceConfig, config_keys, load_config, recorded_value
from appliance.errors import ApplianceError, ConfigError, StopForced

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
    up.add_argument(
        "--engine",
        help="generation engine: auto (default: vllm on GPUs where its venv exists, else torch), torch (in "
        "process) or vllm (own process and venv)",
    )
    up.add_argument("--agent", help="python agent as package.module:function")
    _harness_flags(up)
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
    _placement_flags(up)
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

    evaluate = sub.add_parser(
        "eval",
        help="run the tasks of a validation round (or every task of a split: --all, --split train) "
        "once, or --repeat times, on the run's current policy, with no training; print and record "
        "the reward's mean and standard deviation",
    )
    evaluate.add_argument("--config", type=Path, help="TOML file with config keys (see appliance/config.py)")
    evaluate.add_argument("--data-dir", type=Path, help="run directory (default ./appliance-data)")
    evaluate.add_argument("--model", help="'tiny', 'smollm2-135m', or a local Hugging Face model directory")
    evaluate.add_argument(
        "--engine",
        help="generation engine: auto (default: vllm on GPUs where its venv exists, else torch), "
        "torch or vllm",
    )
    evaluate.add_argument("--device", help="cpu, cuda or auto")
    evaluate.add_argument("--port", type=int, help="proxy port (0: any free port)")
    evaluate.add_argument("--agent", help="python agent as package.module:function")
    _harness_flags(evaluate)
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

    status = sub.add_parser("status", help="print the state of a run from its store")
    status.add_argument("--data-dir", type=Path, default=Path("appliance-data"))
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.add_argument(
        "--failures",
        type=int,
        nargs="?",
        const=10,
        metavar="N",
        help="also list the last N failed rollouts (default 10) with rollout id, task and reason",
    )

    backup = sub.add_parser("backup", help="copy a run consistently, also while it runs")
    backup.add_argument("destination", type=Path, help="a new (or empty) directory for the copy")
    backup.add_argument("--data-dir", type=Path, default=Path("appliance-data"))

    dataset = sub.add_parser(
        "export",
        help="write a run's recorded rollouts as a dataset file (JSONL or Parquet) for SFT or offline RL; "
        "not the model: a clean stop of up exports that to export_dir",
        description="Write a run's recorded rollouts (its event log, read-only: also while it runs, or "
        "a backup) as a dataset: --shape sft, one row per rollout with its OpenAI chat messages and "
        "tools; --shape tokens, one row per trained sample with ids, loss mask, log-probs, versions, "
        "reward and advantage. Not the model export (the final policy a clean stop writes to export_dir).",
    )
    dataset.add_argument(
        "--data-dir", type=Path, default=Path("appliance-data"), help="run directory, or a backup of one"
    )
    dataset.add_argument(
        "--format", choices=("jsonl", "parquet"), default="jsonl", help="file format (default jsonl)"
    )
    dataset.add_argument(
        "--shape",
        choices=("sft", "tokens"),
        default="sft",
        help="sft: one row per rollout, chat messages + tools (default); tokens: one row per trained sample",
    )
    dataset.add_argument("--out", type=Path, required=True, help="the dataset file to write")
    dataset.add_argument(
        "--purpose",
        choices=("training", "validation", "evaluation"),
        action="append",
        help="only rollouts played for this (repeatable; default all)",
    )
    dataset.add_argument("--min-reward", type=float, help="only rollouts with a reward of at least this")
    dataset.add_argument(
        "--steps",
        metavar="A:B",
        help="only rollouts consumed by training steps A..B, inclusive (A:, :B open): trained by the step, "
        "or played by a validation/evaluation round at that step",
    )
    dataset.add_argument(
        "--status",
        choices=("finished", "failed", "any"),
        default="finished",
        help="rollout status to keep (default finished; failed/any for --shape sft only)",
    )

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

    doctor = sub.add_parser(
        "doctor", help="check this machine before a run: torch build, GPUs, vLLM, /dev/shm, RAM, disk"
    )
    doctor.add_argument("--config", type=Path, help="TOML file with config keys (see appliance/config.py)")
    doctor.add_argument("--data-dir", type=Path, help="run directory whose disk is checked")
    doctor.add_argument("--engine", help="the engine the run will use (vllm: its venv must work)")
    doctor.add_argument("--trainer", help="the training backend the run will use (verl: verl must import)")
    doctor.add_argument("--no-vllm", action="store_true", help="do not probe vLLM's interpreter (~5-60 s)")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_plan_parser(sub)
    name_env_variables(up)
    return parser


def name_env_variables(parser: argparse.ArgumentParser) -> None:
    """Append ``(env APPLIANCE_<NAME>)`` to the help of each flag of ``parser`` that sets a
    config field: its destination is the field's user-facing name (``_config_from``), which
    ``load_config`` also reads from the environment. Run once the flags are all added, so a
    flag added later is named too; flags that set no field (``--config``, ``--headless``) get
    nothing."""
    keys = set(config_keys())
    for action in parser._actions:
        if action.dest in keys and action.option_strings and action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} (env {ENV_PREFIX}{action.dest.upper()})".lstrip()


def _placement_flags(parser: argparse.ArgumentParser) -> None:
    """The placement flags ``up`` and ``plan`` share (``appliance.placement``)."""
    parser.add_argument("--placement", help="collocated (default: every GPU generates and trains) or split")
    parser.add_argument(
        "--gpus", type=int, help="use the first N GPUs (default: all; plan --gpu-memory-gib: describe N)"
    )
    parser.add_argument("--engine-replicas", type=int, help="vLLM replicas, each on its own GPUs")
    parser.add_argument("--tensor-parallel-size", type=int, help="GPUs each vLLM replica is sharded over")
    parser.add_argument(
        "--max-model-len", type=int, dest="vllm_max_model_len", metavar="N", help="vLLM's longest sequence"
    )


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="the GPU placement of a model on this machine (or one described); exit 2 if it does not fit",
    )
    plan.add_argument("--gpu-memory-gib", type=float, help="describe a machine whose GPUs have this much")
    plan.add_argument(
        "--ram-gib", type=float, help="host RAM (default: this machine's; unchecked if described)"
    )
    model = plan.add_mutually_exclusive_group()
    model.add_argument("--model", help="'tiny', 'smollm2-135m' or a Hugging Face model directory")
    model.add_argument("--model-params", help="a model of this many parameters: 7e9, 7B, 135M")
    _placement_flags(plan)
    plan.add_argument("--trainer-ranks", type=int, help="training processes, one per GPU (default: derived)")
    plan.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    plan.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations")
    plan.add_argument("--sleep-level", type=int, default=1, help="vLLM's sleep while training: 1 or 2")
    plan.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share of a GPU (default: derived)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def export_command(args: argparse.Namespace) -> int:
    """``lightning-appliance export``: the run's rollouts as a dataset file (``appliance.dataset_export``)."""
    from appliance.config import umask_bits
    from appliance.dataset_export import PURPOSES, STATUSES, ExportFilter, export_dataset, parse_steps

    where = ExportFilter(
        purposes=frozenset(PURPOSES[p] for p in args.purpose) if args.purpose else None,
        min_reward=args.min_reward,
        steps=parse_steps(args.steps) if args.steps is not None else None,
        statuses=STATUSES[args.status],
    )
    umask = umask_bits(load_config(resolved=False).data_umask)  # APPLIANCE_DATA_UMASK
    report = export_dataset(
        args.data_dir, args.out, shape=args.shape, fmt=args.format, where=where, umask=umask
    )
    print(report.line())
    return 0


def plan_command(args: argparse.Namespace) -> int:
    """``lightning-appliance plan``: 0 when the plan fits, 2 when it does not."""
    from appliance.machine import model_spec, probe_machine
    from appliance.memory_model import GIB, ModelSpec, parse_param_count
    from appliance.placement import Machine, PlacementSettings, describe, plan

    defaults = ApplianceConfig()
    spec: ModelSpec | None
    if args.model_params is not None:
        spec = ModelSpec(params=parse_param_count(args.model_params))
    else:
        spec = model_spec(args.model or defaults.model, defaults.models_dir)
        if spec is None:
            known = "not 'tiny', 'smollm2-135m' nor a directory with a config.json"
            raise ApplianceError(f"unknown model {args.model!r}: {known}; or pass --model-params 7B")
    for name in ("gpus", "gpu_memory_gib", "ram_gib"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ApplianceError(f"--{name.replace('_', '-')} must be above 0")
    machine = probe_machine(gpus=args.gpu_memory_gib is None)
    gpus = args.gpus
    if args.gpu_memory_gib is not None:  # a described machine: --gpus of that size
        machine = Machine.described(gpus or 1, round(args.gpu_memory_gib * GIB))
        gpus = None
    elif gpus is not None and gpus > len(machine.gpus):
        have = f"this machine has {len(machine.gpus)} GPU(s)"
        raise ApplianceError(f"{have}; describe one with --gpus {gpus} --gpu-memory-gib G")
    if args.ram_gib is not None:
        machine = Machine(gpus=machine.gpus, ram_bytes=round(args.ram_gib * GIB))
    settings = PlacementSettings(
        placement=args.placement or defaults.placement,
        gpus=gpus,
        engine_replicas=args.engine_replicas,
        tensor_parallel_size=args.tensor_parallel_size,
        trainer_ranks=args.trainer_ranks,
        lora_rank=args.lora_rank,
        gradient_checkpointing=args.gradient_checkpointing,
        tokens_per_microbatch=defaults.trainer.max_tokens_per_microbatch,
        max_model_len=args.vllm_max_model_len,
        max_num_seqs=defaults.engine.max_batch_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        sleep_level=args.sleep_level,
    )
    result = plan(machine, spec, settings)
    print(json.dumps(result.to_json(), indent=2) if args.json else "\n".join(describe(result)))
    return 0 if result.fits else 2


def _harness_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adapter",
        help="harness adapter: a name (python, command, mini-swe-agent, kubernetes, external) or a JSON "
        'table such as \'{"adapter": "command", "command": "my-agent {prompt}"}\' (see '
        "harness_adapters/README.md)",
    )
    parser.add_argument(
        "--tasks", type=Path, help="task set: a JSONL or Parquet file or a datasets directory"
    )


def adapter_flag(value: str | None) -> dict[str, Any] | None:
    """``--adapter`` as the config's adapter table: JSON as it is, a bare name as ``{"adapter": name}``."""
    if value is None:
        return None
    if not value.lstrip().startswith("{"):
        return {"adapter": value}
    try:
        table = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--adapter is neither an adapter name nor a JSON object: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError("--adapter must be an adapter name or a JSON object")
    return table


def _eval_config(args: argparse.Namespace, *, resolved: bool = True) -> ApplianceConfig:
    keys = ("data_dir", "model", "engine", "device", "port", "agent", "tasks")
    overrides: dict[str, Any] = {k: getattr(args, k) for k in keys}
    overrides["adapter"] = adapter_flag(args.adapter)
    return load_config(args.config, overrides, resolved=resolved)


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
    from appliance.evaluation import evaluation_tasks
    from store.outcomes import failures_text, grouped_reasons

    # A bad split or task set fails before anything loads.
    tasks = evaluation_tasks(config, split, every=every)
    async with Appliance(config) as appliance:
        print(
            f"lightning-appliance eval: {len(tasks)} {split} tasks x {repeat}, "
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
    if as_json:
        fields = ("split", "repeat", "step", "policy_version", "reward_mean", "reward_std", "failed")
        reasons = [{"reason": reason, "count": count} for reason, count in grouped_reasons(failed)]
        print(
            json.dumps(
                {
                    **{k: getattr(result, k) for k in fields},
                    "tasks": len(tasks),
                    "rollouts": len(result.rollouts),
                    "failure_reasons": reasons,
                }
            )
        )
    else:
        print(
            f"eval {result.split}: {len(tasks)} tasks x {repeat} = {len(result.rollouts)} rollouts  "
            f"policy v{result.policy_version}  step {result.step}  reward mean {result.reward_mean:.3f}  "
            f"std {result.reward_std:.3f}  " + failures_text(failed),
            flush=True,
        )
    return 0


def _config_from(args: argparse.Namespace, *, resolved: bool = True) -> ApplianceConfig:
    # Each flag is the config field of its name (the flat, user-facing one: ``load_config``
    # puts it into its section).
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
        "mode",
        "eta",
        "lr",
        "trainer",
        "device",
        "trainer_ranks",
        *VERL_ONLY,
        "max_tokens_per_microbatch",
        "push_bucket_mb",
        "placement",
        "gpus",
        "engine_replicas",
        "tensor_parallel_size",
        "vllm_max_model_len",
        "sleep_level",
        "enforce_eager",
        "push_transport",
        "loggers",
    )
    overrides: dict[str, Any] = {k: getattr(args, k) for k in keys}
    overrides.update(adapter=adapter_flag(args.adapter), tasks=args.tasks)
    return load_config(args.config, overrides, resolved=resolved)


def progress_line(step: Any, state: Any, started: float, rollouts_at_start: int) -> str:
    """One line per training step for ``--headless``; its reward is ``status``'s
    (``RunState.step_reward``), its loss the step's own (:func:`loss_text`); the step's
    rollouts that failed, with their reasons (``store.outcomes``), when any did."""
    from store.outcomes import failures_text, state_of

    done = sum(1 for v in state.rollouts.values() if v.status != "running") - rollouts_at_start
    rate = done / max(time.monotonic() - started, 1e-9)
    line = (
        f"step {step.step:>4}  policy v{state.policy_version:<4}  "
        f"reward {reward_text(state.step_reward(step))}  rollouts {len(step.rollouts):>3}  "
        f"samples {step.samples:>3}  tokens {step.tokens:>5}  loss {loss_text(step.metrics.get('loss'))}  "
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


def reward_text(reward: float | None) -> str:
    """A step's mean reward as the progress line and ``status`` print it ("-": none rewarded)."""
    return "-" if reward is None else f"{reward:.3f}"


def loss_text(loss: float | None) -> str:
    """A step's loss to 3 significant digits: "-0.0123", "1.23e-05", "0" ("-": not recorded).
    The policy-gradient surrogate of an on-policy step is about 0 by construction (ratio 1,
    advantages centred per group): a fixed 4 decimals printed every such step as +0.0000."""
    return "-" if loss is None else f"{loss:.3g}"


class _Stopper:
    """What the signals do while ``up`` runs: the first SIGINT/SIGTERM asks for a stop (bounded
    by ``stop_timeout_s``, after which the appliance forces it), a second forces it now, a third
    exits at once. A watchdog thread ends the process ``HARD_EXIT_GRACE_S`` after a forced stop
    if the event loop itself is stuck: the store is crash-consistent, so that loses nothing
    acknowledged. In headless mode it says what the stop waits for, every few seconds."""

    HARD_EXIT_GRACE_S = 15.0
    REPORT_EVERY_S = 10.0

    def __init__(self, appliance: Any, config: ApplianceConfig, *, verbose: bool) -> None:
        self.appliance = appliance
        self.timeout_s = config.stop_timeout_s
        self.verbose = verbose
        self.signals = 0
        self._reporter: asyncio.Task[None] | None = None
        self._watchdog: threading.Timer | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            self.appliance.request_stop()
            self._arm_watchdog(self.timeout_s + self.HARD_EXIT_GRACE_S)
            self._say(
                f"stopping ({name}): waiting for {self.appliance.activity()} "
                f"(at most {self.timeout_s:g} s; send it again to stop now)"
            )
            self._reporter = asyncio.ensure_future(self._report())
        elif self.signals == 2:
            self._say(f"stopping now ({name} again): abandoning {self.appliance.activity()}")
            self.appliance.force_stop(f"{name} received twice")
            self._arm_watchdog(self.HARD_EXIT_GRACE_S)
        else:
            self._say(f"exiting at once ({name} a third time)")
            _hard_exit(130)

    def _arm_watchdog(self, seconds: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

        def expired() -> None:
            print(
                "lightning-appliance: the stop did not finish in time; exiting "
                "(the event log is consistent: a restart resumes)",
                file=sys.stderr,
                flush=True,
            )
            _hard_exit(1)

        self._watchdog = threading.Timer(seconds, expired)
        self._watchdog.daemon = True
        self._watchdog.start()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.REPORT_EVERY_S)
            self._say(f"still stopping: waiting for {self.appliance.activity()}")

    def _say(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self._watchdog is not None and self.appliance.forced is None:
            self._watchdog.cancel()


def _hard_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    stopper = _Stopper(appliance, config, verbose=not dashboard)
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
        _hard_exit(0)
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


def status_report(data_dir: Path, failures: int = 0) -> dict[str, Any]:
    """The run in ``data_dir`` summarised for ``status``; with ``failures``, the last that many
    failed rollouts too (``failures``: rollout, task, purpose and reason)."""
    from store.eventstore import iter_events_sync
    from store.outcomes import grouped_reasons, reason_of, state_counts, state_of
    from store.projections import RunState

    db = data_dir / "events.sqlite"
    if not db.is_file():
        raise ApplianceError(f"no run at {data_dir} (no {db.name}); start one with: lightning-appliance up")
    state = RunState.from_events(iter_events_sync(db))
    summary = state.summary()
    # Every view names a rollout's state the same way (an unclaimed external one is "offered").
    summary["rollouts"] = state_counts(state.rollouts.values())
    failed = [view for view in state.rollouts.values() if state_of(view) == "failed"]
    summary["failure_reasons"] = [
        {"reason": reason, "count": count} for reason, count in grouped_reasons(failed)
    ]
    if failures > 0:
        summary["failures"] = [
            {"rollout": v.rollout, "task_id": v.task_id, "purpose": v.purpose, "reason": reason_of(v)}
            for v in failed[-failures:]
        ]
    summary["steps_detail"] = [
        {
            "step": s.step,
            "rollouts": len(s.rollouts),
            "samples": s.samples,
            "tokens": s.tokens,
            "reward_mean": state.step_reward(s),
            "loss": s.metrics.get("loss"),
        }
        for s in state.steps
    ]
    summary["events"] = state.position
    summary["starts"] = state.starts
    summary["trainer_ranks"] = state.last_start.trainer_ranks if state.last_start is not None else 1
    # The recorded config is nested (by section) or, from earlier versions, flat.
    export_dir = (
        recorded_value(state.last_start.config, "export_dir") if state.last_start is not None else None
    )
    summary["disk_bytes"] = disk_usage(data_dir, Path(export_dir) if export_dir else None)
    summary["checkpoint"] = state.checkpoint
    summary["chain"] = _chain_status(db)

    def round_reasons(rollouts: Sequence[str]) -> list[dict[str, Any]]:
        views = [state.rollouts[r] for r in rollouts if r in state.rollouts]
        return [{"reason": reason, "count": count} for reason, count in grouped_reasons(views)]

    summary["validations"] = [
        {
            "step": v.step,
            "policy_version": v.policy_version,
            "rollouts": len(v.rollouts),
            "failed": v.failed,
            "failure_reasons": round_reasons(v.rollouts),
            "reward_mean": v.reward_mean,
            "reward_std": v.reward_std,
        }
        for v in state.validations
    ]
    summary["evaluations"] = [
        {
            "split": e.split,
            "repeat": e.repeat,
            "step": e.step,
            "policy_version": e.policy_version,
            "rollouts": len(e.rollouts),
            "failed": e.failed,
            "failure_reasons": round_reasons(e.rollouts),
            "reward_mean": e.reward_mean,
            "reward_std": e.reward_std,
        }
        for e in state.evaluations
    ]
    return summary


def disk_usage(data_dir: Path, export_dir: Path | None = None) -> dict[str, int]:
    """Bytes the run takes on disk, by part: ``log`` (``events.sqlite`` with its WAL and
    shared-memory files), the checkpoints by kind (``trainer.checkpoints``): ``checkpoints``
    (full: fp32 weights + optimizer state), ``weights`` (per-version fp32 weights,
    ``checkpoints/weights``) and ``published`` (bf16 copies of published versions,
    ``checkpoints/published``), ``export`` (``export_dir``, None: ``<data_dir>/export``;
    counted also when it lies outside ``data_dir``), the cached ``models``, everything
    ``other`` in ``data_dir``, and their ``total``. Directories count recursively; symbolic
    links are not followed; a file removed while it is counted (a running appliance rotates
    checkpoints) counts 0."""
    checkpoints = data_dir / "checkpoints"
    kinds = {"weights": checkpoints / "weights", "published": checkpoints / "published"}
    try:
        full = [entry for entry in checkpoints.iterdir() if entry not in kinds.values()]
    except OSError:
        full = []
    paths = {
        "log": [data_dir / name for name in ("events.sqlite", "events.sqlite-wal", "events.sqlite-shm")],
        "checkpoints": full,
        **{kind: [path] for kind, path in kinds.items()},
        "export": [export_dir if export_dir is not None else data_dir / "export"],
        "models": [data_dir / "models"],
    }
    counted = {checkpoints.absolute(), *(path.absolute() for part in paths.values() for path in part)}
    try:
        paths["other"] = [entry for entry in data_dir.iterdir() if entry.absolute() not in counted]
    except OSError:
        paths["other"] = []
    parts = {part: sum(_tree_bytes(path) for path in part_paths) for part, part_paths in paths.items()}
    parts["total"] = sum(parts.values())
    return parts


def _tree_bytes(path: Path) -> int:
    """Size of a file, or of every file under a directory; 0 for what is not there."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: "512 B", "3.4 MiB", "1.2 GiB"."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _chain_status(db: Path) -> str:
    """Whether the log's checksum chain holds (status reports a broken one, it does not fail)."""
    from appliance.errors import StoreError
    from store.eventstore import verify_log

    try:
        return f"verified ({verify_log(db).events} events)"
    except StoreError as exc:
        return f"NOT verified: {exc.message}"


def _groups(reasons: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(str(g["reason"]), int(g["count"])) for g in reasons]


def _print_status(summary: dict[str, Any]) -> None:
    from store.outcomes import count_text

    counts = summary["rollouts"]
    reward = summary["mean_reward"]
    print(
        f"run {summary['run_id'] or '-'}  phase {summary['phase']}  starts {summary['starts']}  "
        f"trainer ranks {summary['trainer_ranks']}"
    )
    print(
        f"policy v{summary['policy_version']}  step {summary['step']}  "
        f"checkpoint {summary['checkpoint'] or '-'}  events {summary['events']}"
    )
    print(f"checksum chain {summary['chain']}")
    disk = summary["disk_bytes"]
    print(
        f"disk {human_bytes(disk['total'])} ("
        + ", ".join(f"{part} {human_bytes(disk[part])}" for part in disk if part != "total")
        + ")"
    )
    print(
        "rollouts " + "  ".join(f"{k} {v}" for k, v in counts.items()) + f"  calls {summary['calls']}  "
        f"tokens sampled {summary['tokens_sampled']}"
    )
    if counts.get("failed"):
        print("  " + count_text(counts["failed"], _groups(summary["failure_reasons"])))
    print("last step mean reward " + reward_text(reward))
    for s in summary["steps_detail"]:
        print(
            f"  step {s['step']:>4}  rollouts {s['rollouts']:>3}  samples {s['samples']:>3}  "
            f"tokens {s['tokens']:>5}  reward {reward_text(s['reward_mean'])}  loss {loss_text(s['loss'])}"
        )
    for v in summary["validations"]:
        print(
            f"  validation at step {v['step']:>4}  policy v{v['policy_version']}  "
            f"rollouts {v['rollouts']:>3}  reward {v['reward_mean']:.3f} +- {v['reward_std']:.3f}  "
            + count_text(v["failed"], _groups(v["failure_reasons"]))
        )
    for e in summary.get("evaluations", []):
        print(
            f"  eval {e['split']} at step {e['step']:>4}  policy v{e['policy_version']}  "
            f"rollouts {e['rollouts']:>3} ({e['repeat']}x)  "
            f"reward {e['reward_mean']:.3f} +- {e['reward_std']:.3f}  "
            + count_text(e["failed"], _groups(e["failure_reasons"]))
        )
    if "failures" in summary:
        failures = summary["failures"]
        print(f"last {len(failures)} failed rollouts" if failures else "no failed rollouts")
        for f in failures:
            purpose = "" if f["purpose"] == "train" else f" ({f['purpose']})"
            print(f"  {f['rollout']}  task {f['task_id']}{purpose}  {f['reason']}")


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


#: The exit status of a command whose reader went away (``status | head``): a shell's for a
#: process that SIGPIPE ended, 128 + 13.
EXIT_CLOSED_STDOUT = 128 + signal.SIGPIPE
_P = ParamSpec("_P")


def _quiet_on_closed_stdout(command: Callable[_P, int]) -> Callable[_P, int]:
    """``command`` ending quietly with :data:`EXIT_CLOSED_STDOUT` when its stdout is a pipe
    that was closed (``lightning-appliance status | head -1``), rather than with a
    ``BrokenPipeError`` traceback. Python ignores SIGPIPE, so a write to a closed pipe raises;
    what is still buffered is flushed here, inside the handler, and stdout then points at
    /dev/null so that the interpreter's own flush at exit cannot fail again."""

    @functools.wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> int:
        try:
            code = command(*args, **kwargs)
            sys.stdout.flush()
        except BrokenPipeError:
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            return EXIT_CLOSED_STDOUT
        return code

    return run


@_quiet_on_closed_stdout
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
            summary = status_report(args.data_dir, failures=args.failures or 0)
            if args.json:
                print(json.dumps(summary, indent=2))
            else:
                _print_status(summary)
            return 0
        if args.command == "tui":
            tui_app(args).run()
            return 0
        if args.command == "plan":
            return plan_command(args)
        if args.command == "doctor":
            from appliance import doctor

            overrides = {"data_dir": args.data_dir, "engine": args.engine, "trainer": args.trainer}
            return doctor.run(
                load_config(args.config, overrides), probe_vllm=not args.no_vllm, as_json=args.json
            )
        if args.command == "eval":
            # As for `up`: a run directory another appliance holds is refused before torch loads.
            config = _eval_config(args, resolved=False)
            with preflight.claim(config):
                return _run(
                    _eval(config.with_resolved_device(), args.split, args.repeat, args.json, every=args.every)
                )
        if args.command == "backup":
            from appliance.backup import backup
            from appliance.config import umask_bits

            umask = umask_bits(load_config(resolved=False).data_umask)  # APPLIANCE_DATA_UMASK
            print(backup(args.data_dir, args.destination, umask).line())
            return 0
        if args.command == "export":
            return export_command(args)
        try:
            # The lock and the checks that need no model come before torch is imported: a second
            # appliance on the directory, a port in use or a full disk are refused in a second.
            config = _config_from(args, resolved=False)
            from appliance.tracking import check_backends

            check_backends(config.tracking.loggers)  # a tracker that is not installed: one line
            with preflight.claim(config):
                return _run(_up(config.with_resolved_device(), args.headless))
        finally:
            # The run has stopped: a signal from here on (an impatient Ctrl-C) changes nothing.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
    except StopForced as exc:
        print(f"stopped: {exc.message}", flush=True)
        _hard_exit(0)  # the model may still be loading in a worker thread
        return 0
    except ApplianceError as exc:
        print(f"lightning-appliance: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
