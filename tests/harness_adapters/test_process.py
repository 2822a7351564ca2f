"""Agent processes: the whole tree stops on cancel and timeout, limits hold, exits are described."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from harness_adapters.base import InfraError
from harness_adapters.process import (
    ProcessResult,
    ResourceLimits,
    describe_exit,
    read_tail,
    run_process,
    scrubbed_env,
)
from tests.harness_adapters.support import alive

#: A shell script leaving three kinds of descendants: one in the process group, one in a session
#: of its own (``setsid``, out of the group), and one orphaned by a double fork.
TREE = "sleep 300 & echo $! >> pids; setsid sleep 301 & echo $! >> pids; (sleep 302 & echo $! >> pids) ; wait"


async def run(tmp_path: Path, argv: list[str], **kwargs: object) -> ProcessResult:
    return await run_process(
        argv,
        cwd=tmp_path,
        env=scrubbed_env({}),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
        grace_s=kwargs.pop("grace_s", 1.0),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def read_pids(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()] if path.is_file() else []


async def started_pids(path: Path, count: int) -> list[int]:
    """The pids the script wrote, once there are ``count`` of them."""
    async with asyncio.timeout(10):
        while len(pids := read_pids(path)) < count:  # noqa: ASYNC110 (a file says when, not an event)
            await asyncio.sleep(0.02)
    return pids


async def test_cancel_kills_the_whole_tree_even_outside_the_group(tmp_path: Path) -> None:
    running = asyncio.create_task(run(tmp_path, ["sh", "-c", TREE]))
    pids = await started_pids(tmp_path / "pids", 3)
    assert all(alive(pid) for pid in pids)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert not any(alive(pid) for pid in pids), "a descendant survived the cancel"


async def test_timeout_kills_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    script = "trap '' TERM; " + TREE
    result = await run(tmp_path, ["sh", "-c", script], timeout_s=0.5, grace_s=0.3)
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert result.timed_out
    assert result.describe().startswith("timed out after")
    assert not any(alive(pid) for pid in pids)


async def test_background_children_die_when_the_agent_exits(tmp_path: Path) -> None:
    result = await run(tmp_path, ["sh", "-c", "setsid sleep 303 & echo $! > pids; echo done"])
    assert result.returncode == 0
    assert result.stdout_tail() == "done"
    (pid,) = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert not alive(pid), "a child the agent left behind is still running"


async def test_exit_code_and_output_tails(tmp_path: Path) -> None:
    script = "echo out; for i in $(seq 1000); do echo line$i >&2; done; exit 3"
    result = await run(tmp_path, ["sh", "-c", script])
    assert result.returncode == 3
    assert result.describe() == "exit code 3"
    assert result.stdout_tail() == "out"
    tail = result.stderr_tail(100)
    assert tail.endswith("line1000") and tail.startswith("...")
    assert len(tail) <= 103


async def test_limits_apply_to_the_agent(tmp_path: Path) -> None:
    hog = "bytearray(400 * 1024 * 1024)"
    result = await run(
        tmp_path, [sys.executable, "-c", hog], limits=ResourceLimits(address_space_bytes=200 * 1024 * 1024)
    )
    assert result.returncode == 1
    assert "MemoryError" in result.stderr_tail()
    spin = await run(
        tmp_path, [sys.executable, "-c", "while True: pass"], limits=ResourceLimits(cpu_seconds=1)
    )
    assert spin.describe() == "exit code 152 (SIGXCPU: CPU time limit)"


async def test_a_missing_executable_is_an_infrastructure_failure(tmp_path: Path) -> None:
    with pytest.raises(InfraError, match="not found") as caught:
        await run(tmp_path, ["no-such-agent-binary"])
    assert not caught.value.started
    with pytest.raises(InfraError, match="not found"):
        await run(tmp_path, ["./missing.sh"])


def test_scrubbed_env_keeps_only_what_is_passed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("LICENSE_KEY", "abc")
    env = scrubbed_env({"X": "1"}, passthrough=["LICENSE_KEY"], home=tmp_path)
    assert env["X"] == "1" and env["LICENSE_KEY"] == "abc" and env["HOME"] == str(tmp_path)
    assert "SECRET_TOKEN" not in env
    assert env["PATH"] == os.environ["PATH"]


def test_describe_exit_and_read_tail(tmp_path: Path) -> None:
    assert describe_exit(137) == "exit code 137 (SIGKILL)"
    assert describe_exit(127).startswith("exit code 127 (command not found")
    assert read_tail(tmp_path / "nothing", 10) == ""
