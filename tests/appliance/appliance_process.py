"""Helpers for tests that run ``lightning-appliance up`` as a subprocess, the way a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def up(data_dir: Path, model_dir: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    """Start a headless run of the tiny model: groups of two, one group per step."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "appliance.cli", "up", "--headless",
            "--data-dir", str(data_dir), "--model", str(model_dir), "--port", "0",
            "--steps", str(steps), "--group-size", "2", "--batch-groups", "1", *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``lightning-appliance ARGS`` run to its end, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
