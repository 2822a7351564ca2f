"""The GPU check's report and phase runner: the phases in order and their timeouts, one JSON line
per phase (``Report``), a phase run within its time with the memory it ended with (``Check``), and
the process-tree memory readings (nvidia-smi on CUDA, /proc's RSS on CPU)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
            fields = failure_fields(exc)
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


#: Lines of a failure's text (a vLLM server's log tail, say) kept in its phase's line.
TAIL_LINES = 20


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """A failed phase's ``error`` (the exception's first line), and its text's last
    ``TAIL_LINES`` lines as ``log_tail`` when there is more (a failed vLLM start carries its
    log's end: the likeliest failure of a first GPU run must not leave its cause behind)."""
    fields: dict[str, Any] = {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}
    lines = str(exc).strip().splitlines()
    if len(lines) > 1:
        fields["log_tail"] = lines[-TAIL_LINES:]
    return fields


def last_line(text: str, limit: int = 400) -> str:
    """The last non-empty line: what a traceback on stderr says went wrong (its first line is
    "Traceback (most recent call last):")."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:limit] if lines else ""


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
