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

The torch-only mode has run on one H200 (2026-12-04; docs/benchmarks.md, "GPU check, first
run"); the vLLM mode has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

#: The steps of one collocation cycle, in the scheduler's order.
CYCLE = (
    "sleep",
    "onload",
    "step",
    "checkpoint",
    "offload",
    "wake_weights",
    "push",
    "wake_kv_cache",
    "generate",
    "logprobs",
)
SLEEP_1 = ("sleep", "wake", "generate")
SLEEP_2 = ("sleep", "wake_weights", "push", "wake_kv_cache", "generate", "logprobs")
#: Every phase, in the order they run.
PHASES = (
    "versions",
    "nccl_probe",
    "model",
    "plan",
    "engine_start",
    "trainer_build",
    "generate_0",
    *(f"cycle_{n}/{step}" for n in (1, 2) for step in CYCLE),
    *(f"sleep_1/{step}" for step in SLEEP_1),
    *(f"sleep_2/{step}" for step in SLEEP_2),
    "figures",
    "shutdown",
)
#: Seconds each kind of phase may take (bounded by what is left of the whole run).
TIMEOUTS = {
    "versions": 120.0,
    "nccl_probe": 120.0,
    "model": 180.0,
    "plan": 60.0,
    "engine_start": 300.0,
    "trainer_build": 240.0,
    "step": 180.0,
    "checkpoint": 120.0,
    "shutdown": 60.0,
}
DEFAULT_TIMEOUT_S = 90.0
#: Seconds of the run kept back for the shutdown phase; the last few of them for the watchdog,
#: which ends the run at its limit whatever is still running.
SHUTDOWN_RESERVE_S = 60.0
WATCHDOG_MARGIN_S = 5.0
#: Distributions the torch-only mode imports that a torch-only image may lack (``--fetch-wheels``).
CARRIED = (
    "verl",
    "tensordict",
    "pyvers",
    "orjson",
    "omegaconf",
    "hydra-core",
    "antlr4-python3-runtime",
    "codetiming",
    "dill",
    "aiosqlite",
    # verl 0.9.1 declares transformers < 5.11: the version tested here, not the image's own.
    "transformers",
    "tokenizers",
)
#: Modules imported at module level that the torch-only path never calls (verl: ray, datasets;
#: the torch engine's grammar constraints: llguidance).
STAND_INS = ("ray", "datasets", "llguidance")


class PhaseFailed(Exception):
    """A phase whose check did not hold (the message says what)."""


# --- the report ---------------------------------------------------------------------------------


@dataclass
class Report:
    """The phase lines printed so far, the failed and the not-run phases."""

    deadline: float
    failed: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False
    #: The exit status, once the verdict is printed.
    status: int = 1

    def emit(self, phase: str, ok: bool | None, seconds: float | None, **fields: Any) -> None:
        with self.lock:
            if self.finished or phase in self.done:
                return
            self.done.add(phase)
            if ok is False:
                self.failed.append(phase)
            elif ok is None:
                self.not_run.append(phase)
            line = {"phase": phase, "ok": ok, "seconds": None if seconds is None else round(seconds, 3)}
            print(json.dumps({**line, **fields}, default=str), flush=True)

    def skip(self, phase: str, reason: str) -> None:
        self.emit(phase, None, None, reason=reason)

    def verdict(self, extra_failed: Sequence[str] = ()) -> int:
        """Print the verdict line (phases never reached count as not run); the exit status."""
        for phase in PHASES:
            if phase not in self.done:
                self.skip(phase, "not reached")
        with self.lock:
            if self.finished:
                return self.status
            self.finished = True
            failed = [*self.failed, *extra_failed]
            verdict = "fail" if failed else "pass"
            print(json.dumps({"verdict": verdict, "failed": failed, "not_run": self.not_run}), flush=True)
            self.status = 1 if failed else 0
            return self.status

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Outcome:
    ok: bool
    fields: dict[str, Any]


#: The largest engine-vs-trainer log-prob gap on CUDA by default: the engine in bf16 against the
#: trainer's weights through an fp32 forward. The first H200 run (2026-12-04, torch engine, the
#: random ~0.36B model, 126 tokens) measured 0.033 and 0.026 (``moved`` by a step: 1.9 and 2.4).
CUDA_TOLERANCE = 0.1


class Check:
    """One run: the report, the memory sampler and the phase runner."""

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args = args
        self.report = report
        self.device: str = args.device
        self.engine: Any = None
        self.trainer: Any = None
        #: Whose memory is whose: the engine's server pid (vLLM), set once it runs.
        self.server_pid: int | None = None
        #: The memory each phase ended with (``memory``), by phase.
        self.memories: dict[str, dict[str, Any]] = {}
        self.trainer_ranks = 0
        #: The trainer's rank processes (``trainer_build``): their memory is also summed apart.
        self.trainer_pids: set[int] = set()

    async def phase(
        self,
        name: str,
        body: Callable[[], Awaitable[dict[str, Any]]],
        *,
        kind: str | None = None,
        memory: bool = True,
    ) -> Outcome | None:
        """Run ``body`` as phase ``name`` within its timeout; print its line. None when it did not
        complete (raised or timed out): what needs it is not run."""
        budget = min(TIMEOUTS.get(kind or name, DEFAULT_TIMEOUT_S), self.report.left() - SHUTDOWN_RESERVE_S)
        if name == "shutdown":
            budget = min(TIMEOUTS["shutdown"], self.report.left() - WATCHDOG_MARGIN_S)
        if budget <= 0:
            self.report.skip(name, "the run's time limit was reached")
            return None
        started = time.monotonic()
        completed = False
        try:
            fields = await asyncio.wait_for(body(), budget)
            completed = True
        except TimeoutError:
            fields = {"error": f"timed out after {budget:.0f} s"}
        except PhaseFailed as exc:
            fields = {"error": str(exc)}
        except Exception as exc:
            if self.args.verbose:
                traceback.print_exc(file=sys.stderr)
            fields = {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}
        seconds = time.monotonic() - started
        ok = completed and bool(fields.pop("check_ok", True))
        if memory:
            try:
                fields["memory_mib"] = self.memories[name] = await asyncio.to_thread(self.memory)
            except Exception as exc:  # a figure missing is no reason to stop the run
                fields["memory_mib"] = {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}
        self.report.emit(name, ok, seconds, **fields)
        return Outcome(ok, fields) if completed else None

    def skip_rest(self, phases: Sequence[str], reason: str) -> None:
        """Report ``phases`` as not run (but the shutdown, which runs whatever came before)."""
        for phase in phases:
            if phase != "shutdown":
                self.report.skip(phase, reason)

    # --- memory -------------------------------------------------------------------------------

    def memory(self) -> dict[str, Any]:
        """Memory per process tree (MiB): "vllm" (the server and its children), "appliance/trainer"
        (this process and its other children), "other"; GPU memory on CUDA, RSS on CPU. Once the
        trainer is built, "trainer_ranks" is the part of "appliance/trainer" that its rank
        processes hold (with the torch engine, the rest is the engine in this process)."""
        tree = children_map()
        vllm = descendants(tree, self.server_pid) if self.server_pid is not None else set()
        ours = descendants(tree, os.getpid()) - vllm
        ranks = set().union(*(descendants(tree, pid) for pid in self.trainer_pids)) & ours

        def owner(pid: int) -> str:
            return "vllm" if pid in vllm else "appliance/trainer" if pid in ours else "other"

        totals = {"appliance/trainer": 0.0, "vllm": 0.0}
        if ranks:
            totals["trainer_ranks"] = 0.0

        def count(pid: int, mib: float) -> None:
            who = owner(pid)
            totals[who] = totals.get(who, 0.0) + mib
            if pid in ranks:
                totals["trainer_ranks"] += mib

        if self.device == "cuda":
            apps = nvidia_smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
            if apps is None:
                return {"source": "nvidia-smi", "error": "nvidia-smi did not answer"}
            for line in apps.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 2 and parts[0].isdigit():
                    count(int(parts[0]), float(parts[1]))
            gpu = nvidia_smi(["--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"])
            out: dict[str, Any] = {"source": "nvidia-smi", **totals}
            if gpu:
                used, total = (float(x) for x in gpu.splitlines()[0].split(","))
                out["gpu_used"], out["gpu_total"] = used, total
            cuda: Any = torch.cuda  # (is_initialized is untyped)
            if cuda.is_initialized():
                out["this_process_reserved"] = round(torch.cuda.memory_reserved() / 2**20, 1)
            return out
        for pid in vllm | ours:
            count(pid, rss_mib(pid))
        return {"source": "rss", **{k: round(v, 1) for k, v in totals.items()}}


def one_line(text: str, limit: int = 400) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:limit]


def nvidia_smi(arguments: list[str]) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", *arguments], capture_output=True, text=True, timeout=15, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command may hold spaces and parentheses: the fields after its closing one.
        fields = stat.rsplit(")", 1)[1].split()
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(tree: dict[int, list[int]], root: int) -> set[int]:
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(tree.get(pid, ()))
    return found


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# --- versions -------------------------------------------------------------------------------------

VERSIONS_SNIPPET = """
import json, sys
import torch
nccl = None
if torch.version.cuda is not None:
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception as exc:
        nccl = f"unknown ({type(exc).__name__})"
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda": torch.version.cuda, "nccl": nccl}))
"""


def own_versions() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    # The same snippet in-process: its print is this process's figures.
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(VERSIONS_SNIPPET, namespace)  # a fixed snippet of this file
    versions: dict[str, Any] = json.loads(buffer.getvalue())
    return versions


def vllm_versions(python: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(python), "-c", VERSIONS_SNIPPET],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise PhaseFailed(f"{python} could not report its torch: {one_line(done.stderr[-2000:])}")
    versions: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return versions


# --- the NCCL probe -----------------------------------------------------------------------------


def probe_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """What the probe pushes: a few tensors of several dtypes, the same in both processes."""
    generator = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(64, 32, generator=generator)),
        ("b.weight", torch.randn(300, generator=generator).to(torch.bfloat16)),
        ("c.bias", torch.arange(17, dtype=torch.float32)),
        ("d.weight", torch.randn(128, 64, generator=generator)),
    ]


def probe_setup(device: str, rank: int, gpus: int) -> str:
    """The device of ``rank`` in the probe; on one GPU both ranks share it, each as its own
    "host" for NCCL (which refuses two ranks of one host on one GPU)."""
    if device != "cuda":
        return "cpu"
    index = rank if gpus > 1 else 0
    if gpus < 2:
        os.environ["NCCL_HOSTID"] = f"gpu-check-probe-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def probe_rank0(
    spec: dict[str, Any],
    device: str,
    gpus: int,
    bucket_bytes: int,
    to_member: Any,
    from_member: Any,
    results: Any,
) -> None:
    """Rank 0: host the group, push in buckets; each bucket goes to the member only once rank 0
    has handed it on (the broadcast already called), and rank 0 waits for the member's answer
    before it resumes the generator, as the engine's ``/collective_rpc`` does."""
    try:
        from trainer.weight_group import GroupSpec, WeightGroup, group_buckets

        where = probe_setup(device, 0, gpus)
        group = WeightGroup(GroupSpec(**spec), device=where)
        count = 0
        for bucket in group_buckets(
            probe_tensors(), group=group, bucket_bytes=bucket_bytes, device=torch.device(where)
        ):
            entries = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in bucket.entries]
            message = {
                "entries": entries,
                "nbytes": max(bucket.end, 1),
                "first": bucket.index == 0,
                "last": bucket.last,
            }
            to_member.put(json.dumps(message))
            answer = from_member.get(timeout=spec["timeout_s"])
            if answer.get("error"):
                raise RuntimeError(f"the member failed: {answer['error']}")
            count += 1
        group.close()
        results.put(("rank0", {"buckets": count}))
    except BaseException as exc:
        results.put(("rank0", {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}))


def probe_member(
    spec: dict[str, Any], device: str, gpus: int, to_member: Any, from_member: Any, results: Any
) -> None:
    """The member: joins and receives through the vLLM worker extension's own methods (a
    stand-in worker whose "load" checks the bytes against what rank 0 pushed)."""
    try:
        from appliance.engines.vllm_worker import ApplianceWorkerExtension

        probe_setup(device, 1, gpus)
        expected = dict(probe_tensors())
        checked: list[str] = []

        class ProbeWorker(ApplianceWorkerExtension):
            rank = 0  # the worker's rank within its server (tensor parallelism)

            def _appliance_load(self, spec: dict[str, Any], tensors: Any) -> dict[str, int]:
                _, views = tensors()
                for name, view in views:
                    if not torch.equal(view.cpu(), expected[name]):
                        raise RuntimeError(f"{name} arrived changed")
                    checked.append(name)
                return {"tensors": len(spec["entries"]), "tied_heads": 0}

        worker = ProbeWorker()
        rank = worker.appliance_join_group(json.dumps({**spec, "rank_offset": 1}))
        while True:
            message = to_member.get(timeout=spec["timeout_s"])
            try:
                worker.appliance_receive_bucket(message)
                from_member.put({"ok": True})
            except BaseException as exc:
                from_member.put({"error": f"{type(exc).__name__}: {one_line(str(exc))}"})
                raise
            if json.loads(message)["last"]:
                break
        worker.appliance_leave_group()
        missing = sorted(expected.keys() - set(checked))
        if missing:
            raise RuntimeError(f"never received {missing}")
        results.put(("member", {"rank": rank, "tensors": len(checked)}))
    except BaseException as exc:
        results.put(("member", {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}))


def run_probe(device: str, timeout_s: float) -> dict[str, Any]:
    """Both ranks in spawned processes; "hang" if they have not both finished in ``timeout_s``."""
    from appliance.engines.vllm_process import free_port

    backend = "nccl" if device == "cuda" else "gloo"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    group_timeout = max(5.0, timeout_s / 2)
    spec = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": 2,
        "backend": backend,
        "prefix": "gpu-check-probe",
        "timeout_s": group_timeout,
    }
    context = multiprocessing.get_context("spawn")
    to_member, from_member, results = context.Queue(), context.Queue(), context.Queue()
    # Small buckets: the probe's ~50 KB of tensors take several, so the ordering repeats.
    processes = [
        context.Process(
            target=probe_rank0, args=(spec, device, gpus, 16 << 10, to_member, from_member, results)
        ),
        context.Process(target=probe_member, args=(spec, device, gpus, to_member, from_member, results)),
    ]
    for process in processes:
        process.start()
    answers: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < 2 and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            who, answer = results.get(timeout=0.5)
            answers[who] = answer
    for process in processes:
        process.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    errors = [f"{who}: {a['error']}" for who, a in answers.items() if "error" in a]
    waited = round(timeout_s, 1)
    if len(answers) < 2:
        result, reason = (
            "hang",
            f"no answer from {sorted({'rank0', 'member'} - answers.keys())} in {waited} s",
        )
    elif errors:
        result, reason = "error", "; ".join(errors)
    else:
        result, reason = "pass", None
    fields: dict[str, Any] = {
        "backend": backend,
        "result": result,
        "buckets": answers.get("rank0", {}).get("buckets"),
        "one_gpu_hostid_split": device == "cuda" and gpus < 2,
        "check_ok": result == "pass",
    }
    if reason:
        fields["detail"] = reason
    return fields


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


class Reference:
    """The trainer's log-probs on fixed tokens: its weights through transformers' forward in
    fp32 on the CPU (built once, weights loaded for each reading)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        auto: Any = AutoModelForCausalLM
        self.model: Any = auto.from_config(config, dtype=torch.float32).eval()

    def logprobs(self, state: dict[str, torch.Tensor], prompts: list[list[int]]) -> list[list[float]]:
        self.model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                logits = self.model(ids).logits[0, :-1].float()
                scores = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
                out.append(scores.tolist())
        return out


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
        other = await asyncio.to_thread(vllm_versions, python)
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


def cuda_graph_gib(log: Path) -> float | None:
    """The CUDA graph memory vLLM's last start reported in its log, GiB (None: not there)."""
    import re

    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"Graph capturing finished in\s+\d+\s+secs?,\s*took\s+(-?[\d.]+)\s*GiB", text)
    return float(found[-1]) if found else None


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


class Cycles:
    """generate_0, the two collocation cycles, the two sleep levels."""

    def __init__(self, check: Check, config: Any, model_dir: Path) -> None:
        import random

        self.check = check
        self.config = config
        self.model_dir = model_dir
        self.version = 0
        rng = random.Random(0)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        on_cuda = config.device == "cuda"
        length, count = (64, 8) if on_cuda else (12, 4)
        self.max_tokens = 32 if on_cuda else 8
        self.prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]
        self.fixed = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(2)]
        self.samples: list[Any] = []
        self.previous: list[list[float]] | None = None
        self.reference: Reference | None = None
        tolerance = check.args.logprob_tolerance
        self.tolerance = tolerance if tolerance is not None else (CUDA_TOLERANCE if on_cuda else 1e-3)
        # As ``up``: the trainer's compute dtype, the one the engine serves in (fp32: as it is).
        dtype = getattr(torch, config.engine_dtype())
        self.push_dtype = dtype if dtype != torch.float32 else None
        from trainer.sharded import ShardedStore

        self.store = ShardedStore(config.checkpoint_dir, keep=config.trainer.keep_checkpoints)

    async def run(self) -> None:
        check = self.check
        if await check.phase("generate_0", self.first) is None:
            self.not_run([p for p in PHASES if p.startswith(("cycle_", "sleep_"))], "generate_0 failed")
        else:
            for n in (1, 2):
                if not await self.cycle(n):
                    break
            if await self.sleep_1():
                await self.sleep_2()
        await self.check.phase("figures", self.figures, memory=False)

    async def figures(self) -> dict[str, Any]:
        """What the memory model allows a process to keep on a collocated GPU
        (``memory_model.GPU_CHECK_FIGURES``) against what the phases measured: an offloaded
        trainer rank (``cycle_N/offload``), vLLM asleep (every sleep), vLLM's CUDA graphs (its
        log's "Graph capturing finished ..., took X GiB"). Measured on CUDA only (on CPU memory
        is RSS); vLLM's two with vLLM only (null with the torch engine)."""
        from appliance.placement.memory_model import GPU_CHECK_FIGURES

        allowances = {name: round(value / 2**20) for name, value in GPU_CHECK_FIGURES.items()}
        if self.config.device != "cuda":
            return {"allowance_mib": allowances, "measured_mib": None, "reason": "measured on CUDA"}
        ranks = max(1, self.check.trainer_ranks)
        offloaded = self.largest(("cycle_1/offload", "cycle_2/offload"), "trainer_ranks")
        measured: dict[str, int | float | None] = {
            "TRAINER_OFFLOADED": None if offloaded is None else round(offloaded / ranks),
            "VLLM_ASLEEP": None,
            "VLLM_CUDA_GRAPHS": None,
        }
        if self.config.engine.kind == "vllm":
            asleep = ("cycle_1/sleep", "cycle_2/sleep", "sleep_1/sleep", "sleep_2/sleep")
            graphs = cuda_graph_gib(self.config.data_dir / "logs" / "vllm.log")
            measured["VLLM_ASLEEP"] = self.largest(asleep, "vllm")
            measured["VLLM_CUDA_GRAPHS"] = None if graphs is None else round(graphs * 1024)
        fields: dict[str, Any] = {"allowance_mib": allowances, "measured_mib": measured}
        over = [
            f"{name}: {value} MiB measured, appliance/placement/memory_model.py allows {allowances[name]} MiB"
            for name, value in measured.items()
            if name in allowances and value is not None and value > allowances[name]
        ]
        if over:
            fields.update(check_ok=False, problems=over)
        return fields

    def largest(self, phases: Sequence[str], who: str) -> float | None:
        values = [
            float(memory[who])
            for phase in phases
            if isinstance(memory := self.check.memories.get(phase), dict)
            and isinstance(memory.get(who), float)
        ]
        return max(values) if values else None

    def not_run(self, phases: Sequence[str], reason: str) -> None:
        for phase in phases:
            if phase not in self.check.report.done:
                self.check.report.skip(phase, reason)

    async def generate(self, version: int) -> dict[str, Any]:
        from appliance.engines.base import GenerateRequest, SamplingParams

        engine = self.check.engine
        requests = [
            GenerateRequest(
                prompt_ids=p, params=SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=i)
            )
            for i, p in enumerate(self.prompts)
        ]
        started = time.monotonic()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        seconds = time.monotonic() - started
        versions = sorted({r.policy_version for r in results})
        if versions != [version]:
            raise PhaseFailed(f"the engine served versions {versions}, not {version}")
        self.samples = train_items(self.prompts, results)
        tokens = sum(len(r.token_ids) for r in results)
        return {"version": version, "tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}

    async def engine_logprobs(self) -> list[list[float]]:
        from appliance.engines.base import GenerateRequest, SamplingParams

        engine = self.check.engine
        out = []
        for prompt in self.fixed:
            request = GenerateRequest(
                prompt_ids=prompt,
                params=SamplingParams(max_tokens=1, temperature=1.0, seed=0),
                prompt_logprobs=0,
            )
            result = await engine.generate(request)
            scores = list(result.prompt_logprobs)[1:]
            if any(s is None for s in scores) or len(scores) != len(prompt) - 1:
                raise PhaseFailed("the engine did not score every prompt token")
            out.append([float(s) for s in scores])
        return out

    async def first(self) -> dict[str, Any]:
        fields = await self.generate(0)
        self.previous = await self.engine_logprobs()
        return fields

    async def compare(self, *, pushed_a_step: bool) -> dict[str, Any]:
        served = await self.engine_logprobs()
        state = await asyncio.to_thread(self.check.trainer.state_dict_for_engine)
        if self.reference is None:
            self.reference = await asyncio.to_thread(Reference, self.model_dir)
        trainer = await asyncio.to_thread(self.reference.logprobs, state, self.fixed)
        del state
        diff = max_abs(served, trainer)
        moved = max_abs(served, self.previous) if self.previous is not None else None
        self.previous = served
        fields: dict[str, Any] = {
            "max_abs_diff": diff,
            "mean_abs_diff": mean_abs(served, trainer),
            "moved": moved,
            "tolerance": self.tolerance,
            "tokens": sum(len(s) for s in served),
        }
        problems = []
        if not diff <= self.tolerance:
            problems.append(f"max_abs_diff {diff:.3g} is above the tolerance {self.tolerance:g}")
        if pushed_a_step and moved is not None and not moved > diff:
            problems.append(
                f"the push moved the engine's log-probs by {moved:.3g}, not beyond their diff {diff:.3g}"
            )
        if problems:
            fields.update(check_ok=False, problems=problems)
        return fields

    async def push(self, version: int) -> dict[str, Any]:
        from trainer.buckets import stream_buckets

        count = nbytes = 0
        adapter = None
        trainer = self.check.trainer
        bucket_bytes = int(self.config.trainer.push_bucket_mb) << 20

        def counted() -> Iterator[Any]:
            nonlocal count, nbytes, adapter
            for bucket in trainer.weight_buckets(bucket_bytes, self.push_dtype):
                count += 1
                nbytes += sum(entry.nbytes for entry in bucket.entries)
                adapter = bucket.adapter
                yield bucket

        await self.check.engine.load_weight_buckets(stream_buckets(counted()), version)
        return {
            "version": version,
            "buckets": count,
            "mib": round(nbytes / 2**20, 1),
            "dtype": str(self.push_dtype or "trainer's").removeprefix("torch."),
            # A LoRA run pushes its adapters alone (their rank), else the whole weights (null).
            "adapter_rank": None if adapter is None else adapter.rank,
        }

    async def cycle(self, n: int) -> bool:
        check, engine, trainer = self.check, self.check.engine, self.check.trainer
        version = self.version + 1

        async def step() -> dict[str, Any]:
            out = await asyncio.to_thread(trainer.step, self.samples)
            metrics = out.metrics()
            return {
                "loss": out.loss,
                "grad_norm": out.grad_norm,
                "updated": out.updated,
                "is_weight_mean": metrics["is_weight_mean"],
                "tokens": out.tokens,
                **({} if out.updated else {"check_ok": False, "problems": ["the step did not update"]}),
            }

        async def checkpoint() -> dict[str, Any]:
            trainer.global_step = n
            path = await asyncio.to_thread(trainer.save, self.store, version)
            return {"path": str(path)}

        async def generate() -> dict[str, Any]:
            return await self.generate(version)

        steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "sleep": lambda: timed_none(engine.sleep(1)),
            "onload": lambda: timed_none(asyncio.to_thread(trainer.onload)),
            "step": step,
            "checkpoint": checkpoint,
            "offload": lambda: timed_none(asyncio.to_thread(trainer.offload)),
            "wake_weights": lambda: timed_none(engine.wake(["weights"])),
            "push": lambda: self.push(version),
            "wake_kv_cache": lambda: timed_none(engine.wake(["kv_cache"])),
            "generate": generate,
            "logprobs": lambda: self.compare(pushed_a_step=True),
        }
        for name in CYCLE:
            kind = name if name in TIMEOUTS else None
            if await check.phase(f"cycle_{n}/{name}", steps[name], kind=kind) is None:
                self.not_run(
                    [p for p in PHASES if p.startswith(("cycle_", "sleep_"))], f"cycle_{n}/{name} failed"
                )
                return False
            if name == "push":
                self.version = version
        return True

    async def sleep_1(self) -> bool:
        engine = self.check.engine
        steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "sleep": lambda: timed_none(engine.sleep(1)),
            "wake": lambda: timed_none(engine.wake(["weights", "kv_cache"])),
            "generate": lambda: self.generate(self.version),
        }
        for name in SLEEP_1:
            if await self.check.phase(f"sleep_1/{name}", steps[name]) is None:
                self.not_run([p for p in PHASES if p.startswith("sleep_")], f"sleep_1/{name} failed")
                return False
        return True

    async def sleep_2(self) -> None:
        engine = self.check.engine
        steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "sleep": lambda: timed_none(engine.sleep(2)),
            "wake_weights": lambda: timed_none(engine.wake(["weights"])),
            # Level 2 discarded the weights: the current version is pushed again (the scheduler's way).
            "push": lambda: self.push(self.version),
            "wake_kv_cache": lambda: timed_none(engine.wake(["kv_cache"])),
            "generate": lambda: self.generate(self.version),
            "logprobs": lambda: self.compare(pushed_a_step=False),
        }
        for name in SLEEP_2:
            if await self.check.phase(f"sleep_2/{name}", steps[name]) is None:
                self.not_run([p for p in PHASES if p.startswith("sleep_2/")], f"sleep_2/{name} failed")
                return


async def close_all(check: Check) -> None:
    trainer, engine = check.trainer, check.engine
    check.trainer = check.engine = None
    if trainer is not None and hasattr(trainer, "close"):
        await asyncio.to_thread(trainer.close)
    if engine is not None:
        await engine.close()


async def timed_none(awaitable: Awaitable[Any]) -> dict[str, Any]:
    await awaitable
    return {}


def max_abs(a: list[list[float]], b: list[list[float]]) -> float:
    return max(
        (abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0
    )


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    values = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(values) / len(values) if values else 0.0


def train_items(prompts: list[list[int]], results: Sequence[Any]) -> list[Any]:
    """The engine's generations as training items, every other one rewarded (advantage +-1)."""
    from trainer.items import TrainItem
    from trainer.samples import NOT_SAMPLED, Sample

    items = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        n = len(result.token_ids)
        sample = Sample(
            rollout=f"r{i}",
            call_ids=(f"c{i}",),
            tokens=(*prompt, *result.token_ids),
            loss_mask=(0,) * len(prompt) + (1,) * n,
            logprobs=(0.0,) * len(prompt) + tuple(result.logprobs),
            versions=(NOT_SAMPLED,) * len(prompt) + (result.policy_version,) * n,
        )
        items.append(TrainItem(f"r{i}", 1.0 if i % 2 == 0 else -1.0, (sample,), reward=float(i % 2 == 0)))
    return items


# --- carried wheels ------------------------------------------------------------------------------


def fetch_wheels(directory: Path, python_version: str) -> int:
    """Download the wheels of ``CARRIED`` at this venv's versions for a Linux x86-64 CPython of
    ``python_version``: what the torch-only mode needs on an image with torch alone."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            print(f"{name} is not installed here; not fetched", file=sys.stderr)
    directory.mkdir(parents=True, exist_ok=True)
    platforms = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(directory),
    ]
    target = [
        f"--python-version={python_version}",
        "--implementation=cp",
        *(f"--platform={p}" for p in platforms),
    ]
    failed = []
    for pin in pins:
        if pin.startswith("antlr4"):
            # Published as a source archive only: built into a pure-Python wheel.
            command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(directory), pin]
        else:
            command = [*download, *target, pin]
        if subprocess.call(command, stdout=subprocess.DEVNULL) != 0:
            failed.append(pin)
    size = sum(f.stat().st_size for f in directory.glob("*.whl"))
    print(f"{len(list(directory.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB, in {directory}")
    if failed:
        print(f"not fetched: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def use_wheels(directory: Path) -> Path:
    """Unpack the wheels in ``directory`` (no dependency resolution) into a temporary directory
    put first on the path (this process's and its children's), with stand-ins for ``STAND_INS``
    where they are missing."""
    import atexit
    import importlib.util
    import shutil

    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    atexit.register(shutil.rmtree, site, True)
    for wheel in sorted(directory.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    sys.path.insert(0, str(site))
    for module in STAND_INS:
        if importlib.util.find_spec(module) is None:
            (site / module).mkdir(exist_ok=True)
            (site / module / "__init__.py").write_text(STAND_IN)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    return site


STAND_IN = '''"""Stand-in: verl imports this module at module level; the check's path never calls it."""


class _Inert(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (_Placeholder,), {})


class _Placeholder(metaclass=_Inert):
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert(name, (_Placeholder,), {})
'''


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
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        args.work_dir = work
        return checked_run(args)


if __name__ == "__main__":
    sys.exit(main())
