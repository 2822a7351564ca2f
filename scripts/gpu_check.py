"""GPU check: the collocated time-slice of one GPU, run once through the appliance's own parts.

A straight-line program for a box with one GPU, after ``make`` and ``make vllm``: it builds what
``up`` builds (the placement plan, the engine from ``appliance.engines.factory.create_engine`` with
the plan's ``gpu_memory_utilization``, the verl trainer from ``trainer.factory.make_trainer``) and
drives them as the scheduler does, printing one JSON line per phase and a verdict line last.
Every phase has its own timeout and the whole run is limited (``--timeout``, 600 s by default);
a phase that fails or times out is reported and the phases that need it are not run. Exit status
0 when the verdict is "pass", 1 when it is "fail", 2 for a usage error.

Phases (each line is ``{"phase": ..., "ok": true|false|null, "seconds": ..., ...}``; ``ok`` null
means not run, with ``reason``):

    versions          this interpreter's torch, CUDA and NCCL (``torch.cuda.nccl.version()``) and
                      those of vLLM's interpreter (``.venv-vllm/bin/python``, run apart), and
                      whether they match (``torch_match``, ``nccl_match``): NCCL refuses ranks of
                      another version, so a weight group between the venvs needs one torch
    nccl_probe        torch only, two spawned processes: rank 0 hosts ``trainer.weight_group``'s
                      ``WeightGroup`` and pushes ``group_buckets``; the other joins and receives
                      through the vLLM worker extension's own ``appliance_join_group`` /
                      ``appliance_receive_bucket``, entering each broadcast only after rank 0 has
                      handed the bucket on (as ``/collective_rpc`` delivers it). ``result``:
                      "pass", "hang" (nothing finished in time) or "error". NCCL on CUDA (on one
                      GPU both ranks share it: each gets its own ``NCCL_HOSTID``, so NCCL takes
                      them for two hosts and connects them over sockets), gloo on CPU
    model             the model served and trained: built at random unless ``--model`` is given
                      (CUDA: a ~0.36B Qwen2 in bf16; CPU: the project's tiny model in fp32)
    plan              ``appliance.operations.preflight.check_placement`` on this machine (collocated)
    engine_start      the engine ``up`` would start (vLLM: its command line as the server got it:
                      ``dtype``, ``enforce_eager``, ``gpu_memory_utilization``, sleep mode)
    trainer_build     the verl trainer, built as ``up`` builds it: collocated on GPUs while the
                      engine sleeps, then offloaded and the engine woken (``--trainer-while-awake``:
                      beside the awake engine); ``memory_mib_built``: memory before the hand-over
    generate_0        the first samples (the first step trains on them) and the engine's prompt
                      log-probs on fixed tokens before any push
    cycle_N/<step>    N = 1, 2: sleep -> onload -> step -> checkpoint -> offload -> wake_weights ->
                      push -> wake_kv_cache -> generate -> logprobs; the scheduler's order
    sleep_1/...       sleep level 1, then wake and generate (the weights come back from host RAM)
    sleep_2/...       sleep level 2, wake_weights, push (level 2 discarded them), wake_kv_cache,
                      generate, logprobs
    figures           the memory model's allowances (``memory_model.GPU_CHECK_FIGURES``) against
                      what was measured: an offloaded trainer rank, vLLM asleep, vLLM's CUDA
                      graphs (from its log); a figure above its allowance fails (CUDA; vLLM's
                      two with vLLM only)
    shutdown          the engine and the trainer closed

Every phase from ``engine_start`` on also carries ``memory_mib``: GPU memory per process from
``nvidia-smi --query-compute-apps=pid,used_memory``, summed by process tree into "vllm" (the
server and its children) and "appliance/trainer" (this process and its other children: the
trainer ranks, a torch engine; "trainer_ranks" is the ranks' part of it), "other" for the
rest; on CPU the resident memory of the same trees. ``logprobs`` phases compare the engine's
prompt log-probs (``prompt_logprobs``) on fixed tokens with the trainer's: the trainer's weights
(``state_dict_for_engine``) through transformers' forward in fp32 on the CPU. ``max_abs_diff``
must stay within ``--logprob-tolerance`` and, after a step's push, below ``moved`` (how far the
engine's log-probs moved since the last reading), so a push that did not land fails.

Modes:

    .venv/bin/python scripts/gpu_check.py                        # the whole check (CUDA, vLLM)
    .venv/bin/python scripts/gpu_check.py --torch-only           # no vLLM: the torch engine
    .venv/bin/python scripts/gpu_check.py --torch-only --device cpu   # the same on CPU (gloo)
    .venv/bin/python scripts/gpu_check.py --lora-rank 16          # LoRA: adapters pushed alone

``--torch-only`` serves with the appliance's torch engine instead of vLLM (versions, memory, the
trainer cycle, the probe), for a machine with torch but without vLLM's venv. Where verl and the
project's other dependencies are missing too (a bare device image), ``--fetch-wheels DIR`` (here,
with PyPI) downloads the wheels of this venv's versions that such an image lacks, and ``--wheels
DIR`` (there) unpacks them onto the path first; modules imported but never called on this path
(verl's ray and datasets, the torch engine's grammar library llguidance) get stand-ins.

The check's parts, beside this file (the phases and the command line): ``gpu_check_report.py``
(the phase list, the JSON lines, the phase runner and its memory readings), ``gpu_check_probe.py``
(versions, the NCCL probe), ``gpu_check_cycles.py`` (from generate_0 to the figures) and
``gpu_check_wheels.py`` (``--fetch-wheels``, ``--wheels``).

The torch-only mode has run on one H200 (2026-12-04; docs/benchmarks.md, "GPU check, first
run"); the vLLM mode has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from gpu_check_cycles import Cycles, timed_none  # noqa: E402
from gpu_check_probe import own_versions, run_probe, vllm_versions  # noqa: E402
from gpu_check_report import (  # noqa: E402
    PHASES,
    SHUTDOWN_RESERVE_S,
    TIMEOUTS,
    WATCHDOG_MARGIN_S,
    Check,
    PhaseFailed,
    Report,
    children_map,
    descendants,
    one_line,
)
from gpu_check_wheels import fetch_wheels, use_wheels  # noqa: E402

# --- the model ------------------------------------------------------------------------------------


def build_model(directory: Path, size: str, dtype: torch.dtype) -> dict[str, Any]:
    """A random model with the project's tiny tokenizer: the tiny model itself, or a ~0.36B
    Qwen2 (Qwen2.5-0.5B's layers, the tiny vocabulary). Built on the CPU: no CUDA context here
    before the engine starts, as with ``up``."""
    import shutil

    from transformers import Qwen2Config

    from appliance.engines.tiny_model import build_tiny_model, qwen2_config, random_qwen2

    tiny = build_tiny_model(directory.with_name(directory.name + "-tiny"))
    config = json.loads((tiny / "config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    for source in tiny.iterdir():  # the tokenizer, the chat template, the generation config
        if source.suffix != ".safetensors" and source.name != "config.json":
            shutil.copy2(source, directory / source.name)
    if size == "small":
        model_config = qwen2_config(
            vocab_size=config["vocab_size"],
            eos_token_id=config.get("eos_token_id"),
            pad_token_id=config.get("pad_token_id"),
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            initializer_range=0.02,
        )
    else:
        model_config = Qwen2Config.from_pretrained(tiny)
    model = random_qwen2(model_config, 0)
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": parameters, "vocab": config["vocab_size"]}


# --- the run --------------------------------------------------------------------------------------


async def run(check: Check) -> None:
    """Every phase but the shutdown, in order; what cannot run after a failure is reported."""
    args = check.args
    on_cuda = args.device == "cuda"

    async def versions() -> dict[str, Any]:
        from appliance.engines.vllm_process import vllm_python

        own = own_versions()
        python = vllm_python(Path(args.vllm_python))
        if not python.exists():
            if not args.torch_only:
                raise PhaseFailed(f"vLLM's interpreter {python} does not exist: run `make vllm` first")
            return {"appliance": own, "vllm": None, "torch_match": None, "nccl_match": None}
        try:
            other = await asyncio.to_thread(vllm_versions, python)
        except PhaseFailed as exc:
            if not args.torch_only:
                raise
            # This mode never uses vLLM's venv: a broken one is a fact to record, not a failure.
            return {"appliance": own, "vllm": {"error": str(exc)}, "torch_match": None, "nccl_match": None}
        torch_match = own["torch"].split("+")[0] == other["torch"].split("+")[0]
        nccl_match = own["nccl"] == other["nccl"]
        return {
            "appliance": own,
            "vllm": other,
            "torch_match": torch_match,
            "nccl_match": nccl_match,
            "check_ok": torch_match and nccl_match,
        }

    await check.phase("versions", versions, memory=False)
    await check.phase(
        "nccl_probe",
        lambda: asyncio.to_thread(run_probe, args.device, TIMEOUTS["nccl_probe"] - 20),
        memory=False,
    )

    work = Path(args.work_dir)
    model_dir = Path(args.model) if args.model else work / "model"

    async def model() -> dict[str, Any]:
        if args.model:
            return {"path": str(model_dir), "built": False}
        dtype = torch.bfloat16 if on_cuda else torch.float32
        size = args.model_size or ("small" if on_cuda else "tiny")
        built = await asyncio.to_thread(build_model, model_dir, size, dtype)
        return {
            "path": str(model_dir),
            "built": True,
            "size": size,
            "dtype": str(dtype).removeprefix("torch."),
            **built,
        }

    rest = [p for p in PHASES if p not in ("versions", "nccl_probe")]
    if await check.phase("model", model, memory=False) is None:
        check.skip_rest(rest[1:], "no model")
        return

    plan_holder: dict[str, Any] = {}

    async def plan() -> dict[str, Any]:
        """The config as ``up`` would build it from flags, and its placement plan."""
        from appliance.config import build_config
        from appliance.operations.preflight import check_placement

        config = build_config(
            {
                "data_dir": work / "data",
                "model": str(model_dir),
                "device": args.device,
                "placement": "collocated",
                "engine": "torch" if args.torch_only else "vllm",
                "vllm_python": Path(args.vllm_python),
                "max_batch_size": 8,
                "vllm_max_model_len": 1024,
                "trainer": "verl",
                "lr": args.lr,
                "push_bucket_mb": args.bucket_mb,
                "lora_rank": args.lora_rank,
                "threads": 1 if not on_cuda else None,
            }
        ).with_resolved_device()
        plan_holder["config"] = config
        made = await asyncio.to_thread(check_placement, config)
        if made is None:
            raise PhaseFailed("no placement plan for the model")
        plan_holder["plan"] = made
        return {
            "device": made.device,
            "gpu_memory_utilization": made.gpu_memory_utilization,
            "trainer_ranks": made.trainer_ranks,
            "trainer_gpus": list(made.trainer_gpus),
            "replicas": [list(r) for r in made.replicas],
            "fits": made.fits,
        }

    if await check.phase("plan", plan, memory=False) is None:
        check.skip_rest(rest[2:], "no placement plan")
        return
    made, config = plan_holder["plan"], plan_holder["config"]
    gpus_plan = made.device == "cuda"

    async def engine_start() -> dict[str, Any]:
        from appliance.engines.factory import create_engine

        check.engine = create_engine(
            config,
            model_dir,
            made.replicas if gpus_plan else None,
            made.gpu_memory_utilization if gpus_plan else None,
        )
        await check.engine.start()
        pid = getattr(check.engine, "server_pid", None)
        check.server_pid = pid
        fields: dict[str, Any] = {"engine": config.engine.kind, "server_pid": pid}
        if pid is not None:
            fields["server"] = server_flags(pid)
            if on_cuda:
                flags = fields["server"]
                problems = [
                    what
                    for what, bad in (
                        ("--enforce-eager is set (no CUDA graphs)", flags.get("enforce_eager")),
                        (
                            f"--dtype is {flags.get('dtype')}, not the trainer's {config.engine_dtype()}",
                            flags.get("dtype") != config.engine_dtype(),
                        ),
                        ("--enable-sleep-mode is missing", not flags.get("sleep_mode")),
                        (
                            f"--gpu-memory-utilization is {flags.get('gpu_memory_utilization')}, "
                            f"not the plan's {made.gpu_memory_utilization}",
                            flags.get("gpu_memory_utilization") != made.gpu_memory_utilization,
                        ),
                    )
                    if bad
                ]
                if problems:
                    fields.update(check_ok=False, problems=problems)
        return fields

    if await check.phase("engine_start", engine_start) is None:
        check.skip_rest(rest[3:], "the engine did not start")
        return

    async def trainer_build() -> dict[str, Any]:
        from trainer.factory import make_trainer

        ranks, gpus = config.resolved_trainer_ranks(), None
        if gpus_plan:
            ranks, gpus = made.trainer_ranks, made.trainer_gpus
        # As ``up``: collocated on GPUs the engine sleeps while the trainer is built, then the
        # trainer offloads and the engine wakes (``--trainer-while-awake``: the engine stays
        # awake, the start-up order that overcommits a GPU).
        asleep = gpus_plan and made.placement == "collocated" and not args.trainer_while_awake
        if asleep:
            await check.engine.sleep(config.scheduler.sleep_level)
        check.trainer = await asyncio.to_thread(
            make_trainer,
            "verl",
            model_dir,
            ranks=ranks,
            threads=config.threads,
            gpus=gpus,
            **config.trainer.options(device=config.device, temperature=config.proxy.temperature),
        )
        group = getattr(check.trainer, "group", None)
        check.trainer_ranks = ranks
        check.trainer_pids = set(group.pids()) if group is not None else set()
        fields: dict[str, Any] = {
            "backend": "verl",
            "ranks": ranks,
            "pids": sorted(check.trainer_pids),
            "engine_while_building": "asleep" if asleep else "awake",
            # The trainer built, before anything was handed over: the start-up's peak.
            "memory_mib_built": await asyncio.to_thread(check.memory),
        }
        if asleep:
            await asyncio.to_thread(check.trainer.offload)
            await check.engine.wake()
        return fields

    if await check.phase("trainer_build", trainer_build) is None:
        check.skip_rest(rest[4:], "no trainer")
        return

    await Cycles(check, config, model_dir).run()


def server_flags(pid: int) -> dict[str, Any]:
    """What the server was started with, read from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return {}

    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None

    utilization = value("--gpu-memory-utilization")
    return {
        "dtype": value("--dtype"),
        "enforce_eager": "--enforce-eager" in argv,
        "gpu_memory_utilization": float(utilization) if utilization else None,
        "sleep_mode": "--enable-sleep-mode" in argv,
        "max_model_len": value("--max-model-len"),
    }


async def close_all(check: Check) -> None:
    trainer, engine = check.trainer, check.engine
    check.trainer = check.engine = None
    if trainer is not None and hasattr(trainer, "close"):
        await asyncio.to_thread(trainer.close)
    if engine is not None:
        await engine.close()


# --- main -----------------------------------------------------------------------------------------


def watchdog(check: Check) -> threading.Timer:
    """At the run's limit, however stuck the event loop or a worker thread (a phase that timed
    out leaves its thread running): stop the vLLM server's process group and every child, print
    the verdict (if it was not printed yet), exit with its status."""

    def fire() -> None:
        if check.server_pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(check.server_pid, signal.SIGKILL)
        for pid in descendants(children_map(), os.getpid()) - {os.getpid()}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(check.report.verdict(["the run's time limit"]))

    timer = threading.Timer(max(0.0, check.report.left()), fire)
    timer.daemon = True
    timer.start()
    return timer


async def main_async(check: Check) -> int:
    """Every phase, the shutdown, the verdict; what was started is closed whatever happens."""
    report = check.report
    try:
        try:
            await run(check)
        except Exception as exc:  # the check's own fault: reported as such, what was started closed
            traceback.print_exc(file=sys.stderr)
            report.emit("check", False, None, error=f"{type(exc).__name__}: {one_line(str(exc))}")
        if check.engine is None and check.trainer is None:
            report.skip("shutdown", "nothing was started")
        else:
            await check.phase("shutdown", lambda: timed_none(close_all(check)))
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close_all(check), 60)
    return report.verdict()


def checked_run(args: argparse.Namespace) -> int:
    """The run under its watchdog (cancelled once the event loop and its threads are done)."""
    check = Check(args, Report(deadline=time.monotonic() + args.timeout))
    timer = watchdog(check)
    try:
        return asyncio.run(main_async(check))
    finally:
        timer.cancel()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--torch-only", action="store_true", help="serve with the torch engine: no vLLM")
    parser.add_argument("--model", help="an existing HF model directory (default: a random model)")
    parser.add_argument(
        "--model-size", choices=["tiny", "small"], help="the random model (default: small on cuda)"
    )
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="vLLM's interpreter")
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="the trainer's learning rate (a push must show)"
    )
    parser.add_argument("--bucket-mb", type=int, default=64, help="push bucket size, MiB")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)"
    )
    parser.add_argument("--logprob-tolerance", type=float, help="largest engine-vs-trainer log-prob gap")
    parser.add_argument(
        "--trainer-while-awake",
        action="store_true",
        help="build the trainer with the engine awake (collocated GPUs: up sleeps it first)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="the whole run's limit, seconds")
    parser.add_argument("--work-dir", help="where the model and checkpoints go (default: a temporary one)")
    parser.add_argument("--wheels", help="unpack these wheels onto the path first (a torch-only image)")
    parser.add_argument("--fetch-wheels", metavar="DIR", help="download the wheels --wheels takes, then exit")
    parser.add_argument("--python-version", default="3.12", help="the target of --fetch-wheels")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failed phases on stderr")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.fetch_wheels:
        return fetch_wheels(Path(args.fetch_wheels), args.python_version)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; use --device cpu (with --torch-only for the quick CPU run)",
            file=sys.stderr,
        )
        return 2
    if args.wheels:
        use_wheels(Path(args.wheels))
    if args.timeout <= SHUTDOWN_RESERVE_S + WATCHDOG_MARGIN_S:
        print(
            f"gpu_check: --timeout must exceed {SHUTDOWN_RESERVE_S + WATCHDOG_MARGIN_S:.0f} s",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.work_dir is not None:
        return checked_run(args)
    # Removed after a pass; kept after a failure, with vLLM's log and the run's data in it.
    args.work_dir = tempfile.mkdtemp(prefix="gpu-check-")
    code = checked_run(args)
    if code == 0:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    else:
        print(f"gpu_check: kept for what failed (vLLM's log, the data): {args.work_dir}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
