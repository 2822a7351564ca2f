"""Rewards computed after the agent: a verifier command, a Python function, or a reward file.

Owns the ``RewardSource`` protocol and its implementations. A reward source runs after the
agent exited normally, in the same rollout directory, and returns the rollout's reward, or
``None`` when it has none to give (the agent may still have reported one over HTTP). Whatever
an adapter returns is recorded after any reward the agent reported, so it is the one that
counts: a verifier is authoritative.

* ``VerifierCommand``: a command run in the agent's working directory. ``reward_from``:
  ``exit_code`` (0 -> 1.0, else 0.0), ``stdout`` (the last non-empty line, a float), or
  ``auto`` (the last line if it is a float, else the exit code). A verifier that runs past its
  timeout gives 0.0: hanging tests mean the work is wrong, not that the rollout failed.
* ``RewardFunction``: ``module:function(task, workdir) -> float`` (sync functions run in a
  thread, async ones are awaited).
* ``RewardFile``: the float an agent wrote to ``$LA_REWARD_FILE`` (no HTTP client needed).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from harness_adapters.base import AgentFailed, InfraError, Task
from harness_adapters.process import ProcessResult, ResourceLimits, run_process
from harness_adapters.sandbox import Confinement
from harness_adapters.workdir import RolloutDir

log = logging.getLogger(__name__)

RewardFrom = Literal["auto", "exit_code", "stdout"]
RewardFn = Callable[[Task, Path], float | Awaitable[float]]


@dataclass(frozen=True, slots=True)
class VerifyContext:
    """What a reward source may use: the rollout's directory and how to run a command there."""

    rdir: RolloutDir
    #: The environment for verifier commands (no model credentials).
    env: dict[str, str]
    limits: ResourceLimits | None
    grace_s: float
    #: The sandbox a verifier runs in, for a directory and a step's name (None: unsandboxed):
    #: like the agent's, but without its endpoint, and seeing only the directory it runs in.
    confine: Callable[[RolloutDir, str], Confinement | None] | None = None

    async def run(
        self, name: str, argv: Sequence[str], *, timeout_s: float | None, rdir: RolloutDir | None = None
    ) -> ProcessResult:
        """Run ``argv`` in ``rdir.work`` (default: the agent's working copy), its output in
        ``<name>.stdout`` / ``<name>.stderr`` of the rollout directory. A fresh ``rdir`` (a
        verifier's own checkout) is confined like the agent was, but sees none of the agent's
        directory: only its own ``work``, ``home`` and ``tmp``."""
        where = rdir or self.rdir
        env = self.env
        if rdir is not None:
            env = env | {"HOME": str(rdir.home), "TMPDIR": str(rdir.tmp), "LA_WORKDIR": str(rdir.work)}
        return await run_process(
            argv,
            cwd=where.work,
            env=env,
            stdout_path=self.rdir.log(name, "stdout"),
            stderr_path=self.rdir.log(name, "stderr"),
            limits=self.limits,
            grace_s=self.grace_s,
            timeout_s=timeout_s,
            confinement=self.confine(where, name) if self.confine is not None else None,
        )


class RewardSource(Protocol):
    async def reward(self, task: Task, ctx: VerifyContext) -> float | None:
        """The rollout's reward after the agent exited normally, or None if there is none."""
        ...


def parse_reward(text: str) -> float | None:
    """A finite float, or None."""
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def reward_from_result(result: ProcessResult, mode: RewardFrom) -> float:
    """The reward a finished verifier gave (see the module docstring)."""
    if result.timed_out:
        log.warning("verifier %s: %s; reward 0.0", result.stdout_path.parent.name, result.describe())
        return 0.0
    lines = [line for line in result.stdout_tail().splitlines() if line.strip()]
    printed = parse_reward(lines[-1]) if lines else None
    if mode == "stdout" or (mode == "auto" and printed is not None):
        if printed is None:
            raise InfraError(
                f"the verifier printed no reward on its last line ({result.describe()})", started=True
            )
        return printed
    return 1.0 if result.returncode == 0 else 0.0


@dataclass(frozen=True, slots=True)
class VerifierCommand:
    """Runs ``argv`` (already rendered for the task) in the working directory after the agent."""

    argv: Callable[[Task, RolloutDir], list[str]]
    timeout_s: float = 300.0
    reward_from: RewardFrom = "auto"

    async def reward(self, task: Task, ctx: VerifyContext) -> float:
        result = await ctx.run("verifier", self.argv(task, ctx.rdir), timeout_s=self.timeout_s)
        return reward_from_result(result, self.reward_from)


@dataclass(frozen=True, slots=True)
class RewardFunction:
    fn: RewardFn

    async def reward(self, task: Task, ctx: VerifyContext) -> float:
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(task, ctx.rdir.work)
        else:
            value = await asyncio.to_thread(self.fn, task, ctx.rdir.work)
            if inspect.isawaitable(value):
                value = await value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"reward function {self.fn!r} returned {value!r}, not a finite number")
        return float(value)


@dataclass(frozen=True, slots=True)
class RewardFile:
    """The reward the agent wrote to ``$LA_REWARD_FILE``; None if it wrote none."""

    async def reward(self, task: Task, ctx: VerifyContext) -> float | None:
        try:
            # Not followed if it is a link: the agent made this file, the host reads it.
            fd = os.open(ctx.rdir.reward_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as handle:
            text = handle.read(4096).decode(errors="replace")
        if not text.strip():
            return None
        value = parse_reward(text)
        if value is None:
            raise AgentFailed(f"the agent wrote {text[:80]!r} to LA_REWARD_FILE, not a number")
        return value
