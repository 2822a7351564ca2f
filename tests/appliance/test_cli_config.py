"""``up`` refuses a config that cannot run as the config is built: one line on stderr, exit
status 2, in well under a second of work, before torch is imported or the machine looked at."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_weight_group_on_collocated_gpus_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """NCCL refuses two ranks on one GPU; collocated, rank 0 of the trainer and vLLM's worker
    share every GPU. Refused on any machine, this CPU one included (no GPU is looked for)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    args = ["up", "--device", "cuda", "--placement", "collocated", "--push-transport", "group"]
    args += ["--engine", "vllm", "--trainer", "verl", "--headless", "--data-dir", str(tmp_path / "run")]
    # -X importtime: every module imported is a line on stderr, so torch's absence shows.
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "appliance.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stderr.splitlines()
    imported = {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}
    said = [line for line in lines if not line.startswith("import time:")]
    assert done.returncode == 2, done.stderr
    assert said == [
        'lightning-appliance: push_transport = "group" cannot be used with placement = "collocated" '
        "on cuda: the trainer's rank 0 and a vLLM worker would be two NCCL ranks on one GPU, which "
        "NCCL refuses; use --push-transport files (or auto) or --placement split"
    ]
    assert "appliance.config" in imported
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}
    assert not (tmp_path / "run").exists()


def up_refused(
    *args: str, command: tuple[str, ...] = ("up", "--headless")
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *command, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_refused_up_leaves_nothing_it_created(tmp_path: Path) -> None:
    """A port another process listens on refuses the start; the data directory it would have
    used (and the parents it would have made) are not left behind, nor a lock file in one
    that was there already."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        fresh = tmp_path / "new" / "run"
        done = up_refused("--port", port, "--data-dir", str(fresh))
        assert done.returncode == 2, done.stderr
        assert f"port {port}" in done.stderr and "in use" in done.stderr, done.stderr
        assert list(tmp_path.iterdir()) == []
        # A directory that was there (empty, or with a file of its own) stays as it was.
        existing = tmp_path / "existing"
        existing.mkdir()
        (existing / "notes.txt").write_text("mine")
        done = up_refused("--port", port, "--data-dir", str(existing))
        assert done.returncode == 2, done.stderr
        assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
        # eval claims its directory the same way.
        done = up_refused("--port", port, "--data-dir", str(fresh), command=("eval",))
        assert done.returncode == 2 and "in use" in done.stderr, done.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
