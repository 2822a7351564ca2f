"""Printing commands whose reader goes away (``status | head -1``) end quietly: exit status 141
(a shell's for SIGPIPE), no traceback on stderr."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cli.entry import EXIT_CLOSED_STDOUT
from store.events import Event, TrainStepCompleted
from tests.tui.run_events import run_events, write_run

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "appliance.cli"]


def assert_quiet(stderr: str) -> None:
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert noise not in stderr, stderr


async def test_status_piped_into_head_ends_quietly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # Far more than a pipe holds (64 KiB): one line per step, 6000 steps.
    steps: list[Event] = [
        TrainStepCompleted(
            ts=1_780_000_100.0 + k,
            step=3 + k,
            rollouts=(),
            samples=4,
            tokens=60,
            zero_variance_groups=0,
            metrics={"loss": 0.01},
            duration_s=0.1,
        )
        for k in range(6000)
    ]
    await write_run(run / "events.sqlite", [*run_events(), *steps])
    command = " ".join([*CLI, "status", "--data-dir", str(run)])
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", f"{command} 2>{tmp_path / 'err'} | head -1; exit ${{PIPESTATUS[0]}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("run run-fixture-0001  phase ")
    assert len(done.stdout.splitlines()) == 1
    assert_quiet((tmp_path / "err").read_text())
    assert done.returncode == EXIT_CLOSED_STDOUT == 141


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--model-params", "135M", "--gpus", "1", "--gpu-memory-gib", "80"],
        ["doctor", "--no-vllm", "--data-dir", "."],
    ],
    ids=["plan", "doctor"],
)
def test_a_closed_stdout_ends_plan_and_doctor_quietly(args: list[str], tmp_path: Path) -> None:
    # The reader is gone before the command starts: its first write (at the flush) fails.
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [*CLI, *args],
            cwd=tmp_path,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        os.close(write)
    assert_quiet(done.stderr)
    assert done.returncode == EXIT_CLOSED_STDOUT
