"""SIGKILL between steps, restart: nothing acknowledged is lost and training continues.

Runs the real command line in a subprocess, the way a user runs it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from store.codec import encode
from store.events import (
    ApplianceStarted,
    PolicyVersionPublished,
    RolloutCreated,
    RolloutFinished,
    TrainStepCompleted,
)
from store.eventstore import read_events_sync
from tests.appliance.appliance_process import ROOT, up


def test_sigkill_between_steps_then_resume(tmp_path: Path, tiny_model_dir: Path) -> None:
    data_dir = tmp_path / "run"
    proc = up(data_dir, tiny_model_dir, steps=1000)
    printed_steps: list[int] = []
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step "):
            printed_steps.append(int(line.split()[1]))
            if len(printed_steps) == 2:
                break
        assert time.monotonic() < deadline, "the appliance did not reach step 2 in time"
    # Let the next batch get under way, so rollouts are in flight when the process dies.
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    before = read_events_sync(data_dir / "events.sqlite")
    stored_version = max(
        e.event.policy_version for e in before if isinstance(e.event, PolicyVersionPublished)
    )
    stored_step = max(e.event.step for e in before if isinstance(e.event, TrainStepCompleted))
    assert stored_step >= printed_steps[-1] == 2, "every step printed (acknowledged) is durable"

    target = stored_step + 2
    again = up(data_dir, tiny_model_dir, steps=target)
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    assert f"reached step {target}" in output

    after = read_events_sync(data_dir / "events.sqlite")
    # No acknowledged event was lost or changed: the old log is a prefix of the new one.
    assert [(s.position, encode(s.event)) for s in after[: len(before)]] == [
        (s.position, encode(s.event)) for s in before
    ]
    new = [s.event for s in after[len(before) :]]
    started = [e for e in new if isinstance(e, ApplianceStarted)]
    assert started[0].resumed_from_version == stored_version
    assert started[0].resumed_from_step == stored_step
    versions = [e.policy_version for e in new if isinstance(e, PolicyVersionPublished)]
    assert versions == [stored_version + 1, stored_version + 2]
    # Rollouts in flight at the kill are recorded as interrupted, not forgotten.
    created = {s.event.rollout for s in before if isinstance(s.event, RolloutCreated)}
    ended_before = {s.event.rollout for s in before if isinstance(s.event, RolloutFinished)}
    interrupted = {
        e.rollout for e in new if isinstance(e, RolloutFinished) and e.error.startswith("interrupted")
    }
    assert interrupted == created - ended_before
    # No rollout is trained on twice.
    consumed = [r for s in after if isinstance(s.event, TrainStepCompleted) for r in s.event.rollouts]
    assert len(consumed) == len(set(consumed))

    status = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "status", "--data-dir", str(data_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"step {target}" in status.stdout
    assert "starts 2" in status.stdout
