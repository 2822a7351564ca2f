"""Chaos: break the engine, the trainer and the harness at seeded random points, then SIGKILL or
signal the appliance, restart it on the same data directory, and check after every iteration that
nothing wedged and nothing acknowledged was lost.

Each iteration runs the real command line (``tests/appliance/chaos_run.py``: the CLI with the
engine and the trainer patched to fail as a ``FaultPlan`` says; the agent
``tests/appliance/chaos_agent.py`` fails on the harness side and measures its model calls),
alternating sync and async mode, usually with faults. It ends with a SIGKILL (sometimes during
start-up) or with SIGTERM / SIGINT, sometimes sent twice, timed from the first signal to the exit.
After each iteration:

* the checksum chain verifies, and the log before is a prefix of the log after;
* every printed step is durable; steps and policy versions run 1, 2, 3 ... with no gap;
* a rollout ends at most once; those running at a kill end as "interrupted" at the next start,
  and after a signal stop none is left running; no rollout is trained twice, and a step trains
  only rollouts that had ended;
* a signal stop exits with 0 (or 130) within ``stop_timeout_s`` + ``STOP_MARGIN_S``, its last
  event is ``ApplianceStopped`` (its reason says "forced" when the output does);
* no model call waited longer than its deadline: ``hold_timeout_s`` per time it waited at the
  closed gate, plus the drain's deadline, plus its generation (a slow one's delay) and a margin;
  measured by the agent and recorded as ``LLMCallCompleted.total_s``. Calls the engine lost are
  bounded by the rollout's timeout instead.

At the end a run without faults trains a step, is paused until no rollout runs, and its serving
gate then counts no call in flight (``GET /admin/status``); it stops cleanly on SIGTERM. A failure
names the iteration and its seed: ``CHAOS_SEED=<seed>`` replays the same plan (timings differ).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import APIConnectionError, APIStatusError, OpenAI

from appliance.operations.preflight import LOCK_NAME
from store.codec import EncodedEvent, encode
from store.events import (
    AdmissionsPaused,
    ApplianceStarted,
    ApplianceStopped,
    LLMCallCompleted,
    PhaseOverran,
    PolicyVersionPublished,
    RolloutCreated,
    RolloutFinished,
    TrainStepCompleted,
    TrainStepFailed,
)
from store.eventstore import StoredEvent, read_events_sync, verify_log
from tests.appliance.appliance_process import ROOT
from tests.appliance.chaos_run import FaultPlan, append_line

STOP_TIMEOUT_S = 5.0
#: What a stop may take beyond ``stop_timeout_s`` (closing the parts, the interpreter's exit).
STOP_MARGIN_S = 5.0
HOLD_TIMEOUT_S = 6.0
DRAIN_TIMEOUT_S = 2.0
ROLLOUT_TIMEOUT_S = 12.0
PHASE_TIMEOUT_S = 4.0
#: What a call may take beyond its waits: a generation, the durable append, two busy cores.
CALL_MARGIN_S = 8.0
ENGINE_SLOW_S = 3.0

ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "APPLIANCE_VALIDATE_EVERY": "0",
    "APPLIANCE_CHECKPOINT_EVERY": "3",
    "APPLIANCE_STOP_TIMEOUT_S": str(STOP_TIMEOUT_S),
    "APPLIANCE_HOLD_TIMEOUT_S": str(HOLD_TIMEOUT_S),
    "APPLIANCE_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
    "APPLIANCE_ROLLOUT_TIMEOUT_S": str(ROLLOUT_TIMEOUT_S),
    "APPLIANCE_PHASE_TIMEOUT_S": str(PHASE_TIMEOUT_S),
    "APPLIANCE_BREAKER_FAILURES": "4",
    "APPLIANCE_BREAKER_BACKOFF_S": "2",
    "APPLIANCE_BREAKER_BACKOFF_MAX_S": "8",
}
#: Fault odds per call (engine), per step (trainer) and per rollout (agent) of each profile; an
#: iteration draws one: a mix of everything, a storm on one part, or none.
PROFILES: dict[str, tuple[dict[str, float], dict[str, float], dict[str, float]]] = {
    "mixed": (
        {"raise": 0.06, "hang": 0.06, "slow": 0.15},
        {"raise": 0.15, "hang": 0.08, "slow": 0.25},
        {"raise": 0.1, "no_reward": 0.1, "hang": 0.06},
    ),
    "engine storm": ({"raise": 0.2, "hang": 0.15, "slow": 0.3}, {}, {}),
    "trainer storm": ({}, {"raise": 0.25, "hang": 0.2, "slow": 0.45}, {}),
    "harness storm": ({}, {}, {"raise": 0.5, "no_reward": 0.2, "hang": 0.15}),
    "no faults": ({}, {}, {}),
}
PROFILE_WEIGHTS = (5.0, 1.5, 1.5, 1.5, 1.0)
ACTIONS = ("kill", "SIGTERM", "SIGINT", "SIGINT twice", "SIGTERM then SIGINT")
ACTION_WEIGHTS = (4.0, 2.0, 2.0, 1.0, 1.0)


def call_deadline(preemptions: int, slow_s: float) -> float:
    """The longest a call may legitimately take: each wait at the closed gate is bounded by
    ``hold_timeout_s``, the drain lets it generate at most ``drain_timeout_s`` more."""
    return HOLD_TIMEOUT_S * (1 + preemptions) + DRAIN_TIMEOUT_S + slow_s + CALL_MARGIN_S


def call_admin_route(url: str, token: str, plan: FaultPlan) -> None:
    """Model calls through the admin ``/v1`` route until the process is gone, measured like the
    agent's. They belong to no rollout, so a step does not wait for them to end: a call the
    engine lost is held only by the drain's deadline."""
    rng = random.Random(f"{plan.seed}:admin")
    with OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=120) as client:
        while True:
            seed = rng.getrandbits(62)
            started = time.monotonic()
            outcome, call_id = "ok", ""
            try:
                answer = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "1 + 1"}], max_tokens=8, seed=seed
                )
                call_id = answer.id.removeprefix("chatcmpl-")
            except APIStatusError as exc:
                outcome = f"http {exc.status_code}"
            except APIConnectionError:
                outcome = "connection"
            append_line(
                Path(plan.out_dir) / "calls.jsonl",
                {"rollout": "admin", "seed": seed, "wall_s": time.monotonic() - started, "outcome": outcome,
                 "call_id": call_id},
            )  # fmt: skip
            if outcome == "connection":
                return  # the process stopped or was killed
            time.sleep(rng.uniform(0.0, 0.5))


@dataclass
class Process:
    """One ``up`` under the chaos runner, its output read by a thread."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    @staticmethod
    def start(data_dir: Path, model_dir: Path, plan: Path, mode: str, steps: int) -> Process:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.appliance.chaos_run", str(plan),
             "up", "--headless", "--data-dir", str(data_dir), "--model", str(model_dir),
             "--port", "0", "--steps", str(steps), "--group-size", "2", "--batch-groups", "1",
             "--agent", "tests.appliance.chaos_agent:agent"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**ENV, "APPLIANCE_MODE": mode},
        )  # fmt: skip
        process = Process(proc)
        threading.Thread(target=process._read, daemon=True).start()
        return process

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("lightning-appliance: proxy "):
                self.url = line.split()[2]
                self.ready.set()
            elif line.startswith("stopping ("):
                self.stopping.set()
        self.ready.set()  # it ended: nobody waits for a line that will not come
        self.stopping.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def saved(self, plan: FaultPlan) -> str:
        """Write the whole output beside the plan; returns its tail and where the rest is."""
        path = Path(plan.out_dir) / "output.log"
        path.write_text(self.output)
        return f"--- output (all of it in {path}) ---\n{self.output[-4000:]}"

    def steps(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("step ")]

    def wait_locked(self, lock: Path, timeout: float = 120) -> None:
        """Until the process holds the data directory's lock: its signal handlers are installed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if lock.read_text().strip() == str(self.proc.pid):
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"it never took the lock\n{self.output}")

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hung: no exit within {timeout:g} s\n{self.output}") from None


@dataclass
class Tally:
    """What the chaos did and checked, for the summary line."""

    iterations: int = 0
    modes: Counter[str] = field(default_factory=Counter)
    profiles: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    during_startup: int = 0
    forced: int = 0
    stop_times: list[float] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    #: What the faults led to, from the final log and the agent's calls.
    observed: Counter[str] = field(default_factory=Counter)
    events_checked: int = 0
    steps: int = 0
    calls_measured: int = 0
    calls_recorded: int = 0
    lost_calls: int = 0
    late_sigints: int = 0
    #: The served call that came closest to its deadline: (wall time, deadline).
    tightest: tuple[float, float] = (0.0, 1.0)
    #: The longest wait of a call the engine lost or the agent gave up on.
    longest_unserved: float = 0.0

    def served(self, took: float, deadline: float) -> None:
        if took / deadline > self.tightest[0] / self.tightest[1]:
            self.tightest = (took, deadline)

    def summary(self) -> str:
        kills = self.actions["kill"]
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        took, deadline = self.tightest
        return (
            f"chaos: {self.iterations} iterations ({self.modes['sync']} sync, {self.modes['async']} async), "
            f"{kills} kills, {self.iterations - kills} signal stops "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.actions.items()) if k != 'kill')}; "
            f"{self.forced} forced, {self.late_sigints} SIGINTs after the stop), "
            f"{self.during_startup} during start-up, "
            f"max stop {max(self.stop_times, default=0.0):.1f} s "
            f"(bound {STOP_TIMEOUT_S + STOP_MARGIN_S:g} s), "
            f"profiles: {', '.join(f'{k} {v}' for k, v in sorted(self.profiles.items()))}, "
            f"faults injected: {faults or 'none'}, "
            f"observed: {', '.join(f'{k} {v}' for k, v in sorted(self.observed.items()))}, "
            f"{self.steps} steps, {self.calls_measured} calls measured "
            f"and {self.calls_recorded} recorded ({self.lost_calls} lost by the engine), tightest served "
            f"call {took:.1f} s of its {deadline:.1f} s deadline, longest unserved call "
            f"{self.longest_unserved:.1f} s, {self.events_checked} events checked"
        )


class Chaos:
    """The state the iterations share: the data directory and what the log must keep."""

    def __init__(self, tmp_path: Path, model_dir: Path, seed: int) -> None:
        self.tmp_path = tmp_path
        self.model_dir = model_dir
        self.seed = seed
        self.data_dir = tmp_path / "run"
        self.db = self.data_dir / "events.sqlite"
        self.before: list[tuple[int, EncodedEvent]] = []
        #: Rollouts running when a process was killed: the next start must end them "interrupted".
        self.orphans: set[str] = set()
        self.tally = Tally()

    def plan(self, name: str, seed: int, profile: str) -> tuple[FaultPlan, Path]:
        out = self.tmp_path / name
        out.mkdir()
        engine, trainer, agent = PROFILES[profile]
        plan = FaultPlan(
            seed=seed,
            out_dir=str(out),
            engine=engine,
            trainer=trainer,
            agent=agent,
            engine_slow_s=ENGINE_SLOW_S,
        )
        path = out / "plan.json"
        plan.save(path)
        return plan, path

    def iteration(self, i: int) -> None:
        seed = random.Random(f"{self.seed}:{i}").getrandbits(32)
        rng = random.Random(seed)
        mode = "async" if i % 2 else "sync"
        (profile,) = rng.choices(list(PROFILES), weights=PROFILE_WEIGHTS)
        (action,) = rng.choices(ACTIONS, weights=ACTION_WEIGHTS)
        early = rng.random() < 0.15
        admin_load = not early and rng.random() < 0.5
        delay = rng.uniform(0.0, 3.0) if early else rng.uniform(0.5, 20.0)
        plan, plan_path = self.plan(f"it{i:03d}", seed, profile)
        what = (
            f"chaos iteration {i} (CHAOS_SEED={self.seed}, plan seed {seed}): {mode}, "
            f"{profile}, {action} {delay:.1f} s after "
            f"{'taking the lock' if early else 'the proxy started'}"
            f"{', with calls through the admin route' if admin_load else ''}"
        )
        process = Process.start(self.data_dir, self.model_dir, plan_path, mode, 100_000)
        load: threading.Thread | None = None
        try:
            if admin_load:
                assert process.ready.wait(240) and process.url, "it did not start"
                token = (self.data_dir / "admin_token").read_text().strip()
                load = threading.Thread(target=call_admin_route, args=(process.url, token, plan), daemon=True)
                load.start()
            took = self._end(process, action, early, delay, rng)
            if load is not None:
                load.join(150)
                assert not load.is_alive(), "a call through the admin route never ended"
            self.check(process, plan, signalled=action != "kill", took=took)
        except AssertionError as exc:
            if process.proc.poll() is None:
                process.proc.kill()
            raise AssertionError(f"{what}: {exc}\n{process.saved(plan)}") from None
        process.saved(plan)
        self.tally.iterations += 1
        self.tally.modes[mode] += 1
        self.tally.profiles[profile] += 1
        self.tally.actions[action] += 1
        self.tally.during_startup += early

    def _end(self, process: Process, action: str, early: bool, delay: float, rng: random.Random) -> float:
        """Kill or signal ``process`` as the iteration says; returns seconds from signal to exit."""
        if early:
            process.wait_locked(self.data_dir / LOCK_NAME)
        else:
            assert process.ready.wait(240) and process.url, "it did not start"
        time.sleep(delay)
        assert process.proc.poll() is None, "it exited before it was stopped"
        if action == "kill":
            process.proc.send_signal(signal.SIGKILL)
            process.wait(60)
            assert process.proc.returncode == -signal.SIGKILL
            return 0.0
        first, _, second = action.partition(" ")
        sent = time.monotonic()
        process.proc.send_signal(signal.Signals[first])
        if second:
            again = signal.SIGINT if second in ("twice", "then SIGINT") else signal.SIGTERM
            process.stopping.wait(STOP_TIMEOUT_S + STOP_MARGIN_S)
            time.sleep(rng.uniform(0.0, 0.3) if rng.random() < 0.5 else rng.uniform(0.0, 3.0))
            if process.proc.poll() is None:
                process.proc.send_signal(again)
        process.wait(STOP_TIMEOUT_S + 60)
        return time.monotonic() - sent

    def check(self, process: Process, plan: FaultPlan, *, signalled: bool, took: float) -> None:
        """Every invariant of the module docstring, on the log as this process left it."""
        stored = read_events_sync(self.db) if self.db.exists() else []
        rows = [(s.position, encode(s.event)) for s in stored]
        assert rows[: len(self.before)] == self.before, "history changed: the old log is not a prefix"
        if stored:
            assert verify_log(self.db).events == len(stored), "the checksum chain does not cover the log"
        new = stored[len(self.before) :]
        events = [s.event for s in stored]
        steps = [e for e in events if isinstance(e, TrainStepCompleted)]
        assert set(process.steps()) <= {s.step for s in steps}, "a printed step is not durable"
        assert [s.step for s in steps] == list(range(1, len(steps) + 1)), "steps are not contiguous"
        versions = [e.policy_version for e in events if isinstance(e, PolicyVersionPublished)]
        assert versions == list(range(1, len(versions) + 1)), f"policy versions not contiguous: {versions}"
        ended = _ended(stored)
        finished = [e.rollout for e in events if isinstance(e, RolloutFinished)]
        assert len(finished) == len(set(finished)), "a rollout ended twice"
        consumed = [r for s in steps for r in s.rollouts]
        assert len(consumed) == len(set(consumed)), "a rollout was trained twice"
        for s in stored:
            if isinstance(s.event, TrainStepCompleted):
                early = [r for r in s.event.rollouts if r not in ended or ended[r][0] > s.position]
                assert not early, f"step {s.event.step} trained rollouts that had not ended: {early}"
        started = [s.position for s in new if isinstance(s.event, ApplianceStarted)]
        if started:  # the process recovered: what a kill left running ended as interrupted
            lost = [r for r in self.orphans if r not in ended or ended[r][0] > started[0]]
            assert not lost, f"rollouts running at a kill were not recovered: {sorted(lost)}"
            wrong = [r for r in self.orphans if not ended[r][1].startswith("interrupted")]
            assert not wrong, f"rollouts running at a kill ended otherwise: {wrong}"
            self.orphans.clear()
        created = {e.rollout for e in events if isinstance(e, RolloutCreated)}
        running = created - set(ended)
        if signalled:
            self._check_stop(process, new, started, running, took)
        else:
            self.orphans |= running
        self._check_calls(plan, new)
        for line in _lines(Path(plan.out_dir) / "faults.jsonl"):
            self.tally.faults[f"{line['what']} {line['kind']}"] += 1
        self.tally.events_checked += len(stored)
        self.tally.steps = len(steps)
        self.before = rows

    def _check_stop(
        self, process: Process, new: list[StoredEvent], started: list[int], running: set[str], took: float
    ) -> None:
        code = process.proc.returncode
        # A SIGINT that arrives once the stop is done meets Python's own handler in the
        # interpreter's exit: a KeyboardInterrupt, status -2 (130 in a shell). Nothing is lost.
        late_sigint = code == -signal.SIGINT and "\nstopped: " in process.output
        assert code in (0, 130) or late_sigint, f"a signal stop exited with {code}"
        self.tally.late_sigints += late_sigint
        self.tally.stop_times.append(took)
        assert took <= STOP_TIMEOUT_S + STOP_MARGIN_S, (
            f"the stop took {took:.1f} s (stop_timeout_s {STOP_TIMEOUT_S:g} + {STOP_MARGIN_S:g})"
        )
        forced = "stop forced" in process.output
        self.tally.forced += forced
        if started:
            last = new[-1].event
            assert isinstance(last, ApplianceStopped), f"the last event is {type(last).__name__}"
            assert not forced or "forced" in last.reason, f"a forced stop recorded as {last.reason!r}"
        else:  # stopped before it started: at most the recovery was recorded
            assert all(isinstance(s.event, RolloutFinished) for s in new), "events without a start"
        assert not running, f"rollouts left running after a stop: {sorted(running)}"

    def _check_calls(self, plan: FaultPlan, new: list[StoredEvent]) -> None:
        """No call waited past its deadline, as the agent measured it and as the log records it."""
        recorded = {s.event.call_id: s.event for s in new if isinstance(s.event, LLMCallCompleted)}
        for call in _lines(Path(plan.out_dir) / "calls.jsonl"):
            fault, slow = plan.engine_fault(int(call["seed"]))
            took = float(call["wall_s"])
            self.tally.calls_measured += 1
            if call["outcome"] != "ok":
                self.tally.observed[f"calls {call['outcome']}"] += 1
            if call["outcome"] == "cancelled" or fault == "hang":
                self.tally.lost_calls += fault == "hang"
                self.tally.longest_unserved = max(self.tally.longest_unserved, took)
                deadline = ROLLOUT_TIMEOUT_S + CALL_MARGIN_S  # the agent's own timeout ends it
            else:
                event = recorded.get(call["call_id"])
                deadline = call_deadline(event.preemptions if event is not None else 1, slow)
                self.tally.served(took, deadline)
            assert took <= deadline, f"a call waited {took:.1f} s, past its deadline {deadline:.1f} s: {call}"
        for event in recorded.values():
            seed = event.request.get("seed")
            fault, slow = plan.engine_fault(int(seed)) if isinstance(seed, int) else ("none", 0.0)
            self.tally.calls_recorded += 1
            if fault == "hang":
                continue  # lost by the engine: it ends when a drain preempts it or the stop ends it
            deadline = call_deadline(event.preemptions, slow)
            assert event.total_s <= deadline, (
                f"call {event.call_id} of {event.rollout} took {event.total_s:.1f} s, past its deadline "
                f"{deadline:.1f} s (preemptions {event.preemptions}, engine fault {fault})"
            )

    def final(self) -> None:
        """A run without faults trains a step, drains when paused, and stops cleanly."""
        plan, plan_path = self.plan("final", self.seed, "no faults")
        stored_step = self.tally.steps
        process = Process.start(self.data_dir, self.model_dir, plan_path, "sync", 100_000)
        try:
            assert process.ready.wait(240) and process.url, "it did not start"
            deadline = time.monotonic() + 300
            while not any(step > stored_step for step in process.steps()):
                assert process.proc.poll() is None, "it exited"
                assert time.monotonic() < deadline, "no step within 300 s without faults"
                time.sleep(0.2)
            token = (self.data_dir / "admin_token").read_text().strip()
            with httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {token}"}) as http:
                http.post("/admin/control", json={"action": "pause", "source": "chaos"}).raise_for_status()
                status: dict[str, Any] = {}
                deadline = time.monotonic() + ROLLOUT_TIMEOUT_S + 60
                while status.get("rollouts") != 0 or not status.get("paused"):
                    assert time.monotonic() < deadline, f"rollouts did not end while paused: {status}"
                    time.sleep(0.2)
                    status = http.get("/admin/status").json()
                assert status["inflight"] == 0, f"calls counted in flight with none running: {status}"
                assert status["serving"], status
            sent = time.monotonic()
            process.proc.send_signal(signal.SIGTERM)
            process.wait(STOP_TIMEOUT_S + 60)
            self.check(process, plan, signalled=True, took=time.monotonic() - sent)
            assert process.proc.returncode == 0
            assert "stop forced" not in process.output, "a paused run had to be forced to stop"
        except AssertionError as exc:
            if process.proc.poll() is None:
                process.proc.kill()
            raise AssertionError(
                f"chaos final run (CHAOS_SEED={self.seed}): {exc}\n{process.saved(plan)}"
            ) from None
        status_out = subprocess.run(
            [sys.executable, "-m", "appliance.cli", "status", "--data-dir", str(self.data_dir)],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert f"checksum chain verified ({len(self.before)} events)" in status_out.stdout, status_out.stdout
        ended: set[str] = set()
        for s in read_events_sync(self.db):
            match s.event:
                case RolloutFinished(rollout=rollout):
                    ended.add(rollout)
                case LLMCallCompleted(rollout=rollout, preemptions=preemptions):
                    self.tally.observed["calls preempted"] += preemptions > 0
                    self.tally.observed["calls recorded after their rollout ended"] += rollout in ended
                case PhaseOverran(phase=phase):
                    self.tally.observed[f"{phase} overran"] += 1
                case AdmissionsPaused() | TrainStepFailed():
                    self.tally.observed[type(s.event).__name__] += 1


def _ended(stored: list[StoredEvent]) -> dict[str, tuple[int, str]]:
    """Each ended rollout's ``RolloutFinished``: (position, error)."""
    return {
        s.event.rollout: (s.position, s.event.error) for s in stored if isinstance(s.event, RolloutFinished)
    }


def _lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file written by the killed process (a last line cut by the kill is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def chaos(tmp_path: Path, model_dir: Path, iterations: int, seed: int) -> Tally:
    run = Chaos(tmp_path, model_dir, int(os.environ.get("CHAOS_SEED", seed)))
    for i in range(iterations):
        run.iteration(i)
    run.final()
    print(run.tally.summary())
    return run.tally


@pytest.mark.timeout(600)
def test_chaos_three_iterations(tmp_path: Path, tiny_model_dir: Path) -> None:
    tally = chaos(tmp_path, tiny_model_dir, iterations=3, seed=13)
    assert tally.iterations == 3 and tally.events_checked > 0


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_chaos_fifty_iterations(tmp_path: Path, tiny_model_dir: Path) -> None:
    iterations = int(os.environ.get("CHAOS_ITERATIONS", "50"))
    tally = chaos(tmp_path, tiny_model_dir, iterations=iterations, seed=1313)
    assert tally.actions["kill"] > 0 and tally.iterations - tally.actions["kill"] > 0
    assert tally.steps > 0 and sum(tally.faults.values()) > 0
