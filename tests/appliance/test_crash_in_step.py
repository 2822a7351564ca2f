"""SIGKILL while a training step is inside the trainer, restart: training continues from the
last durable version with the same step count, and no rollout is trained twice.

Runs the real command line in subprocesses. The first run blocks its fourth trainer step (see
``tests/appliance/slow_train.py``) so the kill lands inside it, deterministically.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store.codec import encode
from store.events import (
    ApplianceStarted,
    CheckpointSaved,
    ModelExported,
    PhaseChanged,
    PolicyVersionPublished,
    TrainStepCompleted,
)
from store.eventstore import read_events_sync
from store.projections import RunState

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "APPLIANCE_CHECKPOINT_EVERY": "2",
    "APPLIANCE_VALIDATE_EVERY": "0",
}


def up_args(data_dir: Path, model_dir: Path, steps: int) -> list[str]:
    return [
        "up", "--headless", "--data-dir", str(data_dir), "--model", str(model_dir), "--port", "0",
        "--steps", str(steps), "--group-size", "2", "--batch-groups", "1",
    ]  # fmt: skip


# Two processes, about 30-45 s on two cores; kept in the default suite so CI runs it.
def test_sigkill_inside_a_training_step_then_resume(tmp_path: Path, tiny_model_dir: Path) -> None:
    data_dir = tmp_path / "run"
    marker = tmp_path / "inside-step"
    with (tmp_path / "first.log").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.appliance.slow_train", str(marker), "4",
             *up_args(data_dir, tiny_model_dir, 1000)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the appliance did not reach its fourth step in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    before = read_events_sync(data_dir / "events.sqlite")
    state = RunState.from_events(before)
    # The kill landed inside step 4: its switch began, its step never became durable.
    assert state.step == 3
    phases = [s.event.phase for s in before if isinstance(s.event, PhaseChanged)]
    assert phases[-1] == "train"
    assert not isinstance(before[-1].event, TrainStepCompleted)
    in_step = {view.rollout for views in state.ready_groups().values() for view in views}
    assert in_step, "the interrupted step had rollouts to train"
    published = {
        s.event.policy_version: s.event.checkpoint
        for s in before
        if isinstance(s.event, PolicyVersionPublished)
    }
    # Version 3 lives in a weights file; its optimizer state comes from the full checkpoint of step 2.
    assert published[state.policy_version] == f"checkpoints/weights/v{state.policy_version:06d}.pt"
    assert [(s.event.reason, s.event.step) for s in before if isinstance(s.event, CheckpointSaved)] == [
        ("periodic", 2)
    ]

    target = state.step + 2
    again = subprocess.run(
        [sys.executable, "-m", "appliance.cli", *up_args(data_dir, tiny_model_dir, target)],
        cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"reached step {target}" in again.stdout

    after = read_events_sync(data_dir / "events.sqlite")
    # Nothing durable was lost or changed: the old log is a prefix of the new one.
    assert [(s.position, encode(s.event)) for s in after[: len(before)]] == [
        (s.position, encode(s.event)) for s in before
    ]
    new = [s.event for s in after[len(before) :]]
    (started,) = [e for e in new if isinstance(e, ApplianceStarted)]
    assert (started.resumed_from_step, started.resumed_from_version) == (3, state.policy_version)
    steps = [e for e in new if isinstance(e, TrainStepCompleted)]
    assert [s.step for s in steps] == [4, 5], "step numbering continues from the stored step"
    # The interrupted step's rollouts are trained exactly once: by the first step after restart.
    assert set(steps[0].rollouts) == in_step
    consumed = [r for s in after if isinstance(s.event, TrainStepCompleted) for r in s.event.rollouts]
    assert len(consumed) == len(set(consumed))
    saved = [(e.reason, e.step) for e in new if isinstance(e, CheckpointSaved)]
    assert saved == [("periodic", 4), ("shutdown", 5)]
    (exported,) = [e for e in new if isinstance(e, ModelExported)]
    assert exported.step == 5
    assert (Path(exported.path) / "config.json").is_file()
