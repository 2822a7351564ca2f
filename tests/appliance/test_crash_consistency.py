"""SIGKILL the appliance under load at random points, restart, and check the log after each kill.

A real ``lightning-appliance up`` runs the tiny model with its agents and trains, while a client
thread makes chat calls through the admin ``/v1`` route. Acknowledged are: every call answered
200 (its ``LLMCallCompleted`` was durable before the answer) and every printed step line. After
each kill: the log before the kill is a prefix of the log after the restart, every acknowledged
call and step is in it, and its checksum chain verifies. At the end (a clean stop): every
rollout created has ended, those in flight at a kill as "interrupted", and no rollout was
trained twice.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from openai import OpenAI

from store.codec import encode
from store.events import LLMCallCompleted, RolloutCreated, RolloutFinished, TrainStepCompleted
from store.eventstore import read_events_sync, verify_log
from tests.appliance.appliance_process import ROOT, up


@dataclass
class Acknowledged:
    """What the killed process acknowledged to the outside before it died."""

    calls: set[str] = field(default_factory=set)
    steps: list[int] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    first_call: threading.Event = field(default_factory=threading.Event)


def load(base_url: str, token: str, acked: Acknowledged, stop: threading.Event) -> None:
    """Chat calls through the admin route until ``stop`` or the server dies; records answered ids."""
    client = OpenAI(base_url=base_url + "/v1", api_key=token, max_retries=0, timeout=30)
    n = 0
    while not stop.is_set():
        n += 1
        try:
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"call {n}"}], max_tokens=4
            )
        except Exception:  # the process was killed (or held past its timeout): not acknowledged
            if stop.wait(0.05):
                return
            continue
        acked.calls.add(answer.id.removeprefix("chatcmpl-"))
        acked.first_call.set()


def run_and_kill(data_dir: Path, model_dir: Path, *, during_startup: bool, after_s: float) -> Acknowledged:
    """Start the appliance and SIGKILL it ``after_s`` seconds after its start (``during_startup``)
    or after the first call through its proxy was answered (then under load)."""
    proc = up(data_dir, model_dir, 100_000)
    acked = Acknowledged()
    stop = threading.Event()
    ready = threading.Event()
    url: list[str] = []

    def read_output() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            acked.output.append(line)
            if line.startswith("lightning-appliance: proxy "):
                url.append(line.split()[2])
                ready.set()
            elif line.startswith("step "):
                acked.steps.append(int(line.split()[1]))

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    loader: threading.Thread | None = None
    if during_startup:
        time.sleep(after_s)
    else:
        assert ready.wait(180), "".join(acked.output)
        token = (data_dir / "admin_token").read_text().strip()
        loader = threading.Thread(target=load, args=(url[0], token, acked, stop), daemon=True)
        loader.start()
        assert acked.first_call.wait(180), "".join(acked.output)
        time.sleep(after_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    stop.set()
    reader.join(timeout=30)
    if loader is not None:
        loader.join(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(acked.output)
    return acked


def check_after_kill(db: Path, acked: Acknowledged, before: list[tuple[int, object]]) -> int:
    """Checks on the log of a killed process; returns how many events it holds."""
    stored = read_events_sync(db)
    assert [(s.position, encode(s.event)) for s in stored[: len(before)]] == before, "history changed"
    calls = {s.event.call_id for s in stored if isinstance(s.event, LLMCallCompleted)}
    assert acked.calls <= calls, f"acknowledged calls lost: {sorted(acked.calls - calls)}"
    steps = {s.event.step for s in stored if isinstance(s.event, TrainStepCompleted)}
    assert set(acked.steps) <= steps, "a printed step is not durable"
    assert verify_log(db).events == len(stored)
    return len(stored)


def crash_loop(tmp_path: Path, model_dir: Path, kills: int, seed: int) -> tuple[int, int, int]:
    """``kills`` random kills then a clean run; returns (events checked, calls acked, steps acked)."""
    rng = random.Random(seed)
    data_dir = tmp_path / "run"
    db = data_dir / "events.sqlite"
    before: list[tuple[int, object]] = []
    checked = acked_calls = acked_steps = 0
    running_at_kills: set[str] = set()  # in flight when a process died
    for _ in range(kills):
        # Some kills land during start-up and recovery, most while rollouts, calls and steps run.
        during_startup = rng.random() < 0.2
        acked = run_and_kill(
            data_dir, model_dir, during_startup=during_startup, after_s=rng.uniform(0.5, 5.0)
        )
        if db.exists():
            checked += check_after_kill(db, acked, before)
            stored = read_events_sync(db)
            before = [(s.position, encode(s.event)) for s in stored]
            created = {s.event.rollout for s in stored if isinstance(s.event, RolloutCreated)}
            ended = {s.event.rollout for s in stored if isinstance(s.event, RolloutFinished)}
            running_at_kills |= created - ended
        acked_calls += len(acked.calls)
        acked_steps += len(acked.steps)

    stored_step = max((e.step for _, e in _events(db) if isinstance(e, TrainStepCompleted)), default=0)
    final = up(data_dir, model_dir, stored_step + 1)
    output, _ = final.communicate(timeout=300)
    assert final.returncode == 0, output
    after = read_events_sync(db)
    assert [(s.position, encode(s.event)) for s in after[: len(before)]] == before
    assert verify_log(db).events == len(after)
    created = {s.event.rollout for s in after if isinstance(s.event, RolloutCreated)}
    finished = [s.event for s in after if isinstance(s.event, RolloutFinished)]
    assert created <= {e.rollout for e in finished}, "a rollout was forgotten"
    assert len({e.rollout for e in finished}) == len(finished), "a rollout ended twice"
    interrupted = [e for e in finished if e.error.startswith("interrupted")]
    assert running_at_kills <= {e.rollout for e in interrupted}, "a rollout in flight was not recovered"
    consumed = [r for s in after if isinstance(s.event, TrainStepCompleted) for r in s.event.rollouts]
    assert len(consumed) == len(set(consumed)), "a rollout was trained twice"
    # A step consumes only rollouts that had ended (interrupted ones are consumed, never trained).
    ended_at = {s.event.rollout: s.position for s in after if isinstance(s.event, RolloutFinished)}
    for s in after:
        if isinstance(s.event, TrainStepCompleted):
            assert all(ended_at[r] < s.position for r in s.event.rollouts), f"step {s.event.step}"
    status = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "status", "--data-dir", str(data_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"checksum chain verified ({len(after)} events)" in status.stdout
    return checked + len(after), acked_calls, acked_steps


def _events(db: Path) -> list[tuple[int, object]]:
    return [(s.position, s.event) for s in read_events_sync(db)] if db.exists() else []


def test_sigkill_under_load_loses_nothing_acknowledged(tmp_path: Path, tiny_model_dir: Path) -> None:
    checked, calls, _ = crash_loop(tmp_path, tiny_model_dir, kills=2, seed=1)
    assert calls > 0 and checked > 0


@pytest.mark.slow
def test_twenty_sigkills_under_load(tmp_path: Path, tiny_model_dir: Path) -> None:
    checked, calls, steps = crash_loop(tmp_path, tiny_model_dir, kills=20, seed=2)
    print(f"20 kills survived: {checked} events checked, {calls} calls and {steps} steps acknowledged")
    assert calls > 0 and steps > 0
