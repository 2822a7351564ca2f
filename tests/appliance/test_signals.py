"""SIGTERM and SIGINT stop ``lightning-appliance up`` within ``stop_timeout_s`` in every phase,
a second SIGINT stops at once, and headless mode says what the stop waits for.

Runs the real command line in subprocesses; a trainer step that never returns
(``tests/appliance/slow_train.py``) stands for any phase that would not end by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store.events import ApplianceStopped, TrainStepCompleted
from store.eventstore import read_events_sync, verify_log

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, model_dir: Path, marker: Path, stop_timeout_s: float) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "APPLIANCE_VALIDATE_EVERY": "0",
        "APPLIANCE_STOP_TIMEOUT_S": str(stop_timeout_s),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.appliance.slow_train", str(marker), "2",
         "up", "--headless", "--data-dir", str(tmp_path / "run"), "--model", str(model_dir),
         "--port", "0", "--steps", "100", "--group-size", "2", "--batch-groups", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def _wait_for(marker: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the appliance did not reach its second step in time"
        time.sleep(0.05)


def test_sigterm_inside_a_step_that_never_ends_stops_within_the_bound(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    marker = tmp_path / "inside-step"
    proc = _start(tmp_path, tiny_model_dir, marker, stop_timeout_s=3)
    _wait_for(marker, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 0, output
    assert took < 3 + 10, f"stopped after {took:.1f} s"
    assert "stopping (SIGTERM): waiting for training step 2: train" in output, output
    assert "stopped: stop forced: it did not end within 3 s" in output, output
    db = tmp_path / "run" / "events.sqlite"
    assert verify_log(db).events > 0
    events = [s.event for s in read_events_sync(db)]
    assert [e.step for e in events if isinstance(e, TrainStepCompleted)] == [1]
    assert isinstance(events[-1], ApplianceStopped) and "forced" in events[-1].reason

    # A restart trains the abandoned step's groups; nothing is trained twice.
    resumed = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "up", "--headless", "--data-dir", str(tmp_path / "run"),
         "--model", str(tiny_model_dir), "--port", "0", "--steps", "2", "--group-size", "2",
         "--batch-groups", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "APPLIANCE_VALIDATE_EVERY": "0"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    events = [s.event for s in read_events_sync(db)]
    steps = [e for e in events if isinstance(e, TrainStepCompleted)]
    assert [s.step for s in steps] == [1, 2]
    trained = [r for s in steps for r in s.rollouts]
    assert len(trained) == len(set(trained))


def test_a_second_sigint_stops_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    marker = tmp_path / "inside-step"
    proc = _start(tmp_path, tiny_model_dir, marker, stop_timeout_s=300)
    _wait_for(marker, proc)
    assert proc.stdout is not None
    proc.send_signal(signal.SIGINT)
    lines: list[str] = []
    while not any(line.startswith("stopping (SIGINT)") for line in lines):
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    took = time.monotonic() - sent
    assert proc.returncode == 0, output
    assert took < 10, f"stopped {took:.1f} s after the second SIGINT"
    assert "stopping now (SIGINT again): abandoning training step 2: train" in output, output
    assert "stopped: stop forced: SIGINT received twice" in output, output
    assert verify_log(tmp_path / "run" / "events.sqlite").events > 0
