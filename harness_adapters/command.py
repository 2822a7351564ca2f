"""The ``command`` adapter: any executable, pointed at the rollout, with no change to the agent.

Owns running one agent process per rollout: a fresh rollout directory (with a copy of the
task's repo snapshot, if the task names one in ``repo_field``), the agent's argv from a
template, a scrubbed environment, resource limits, and the reward afterwards.

The agent's environment is only: PATH, LANG, LC_ALL, TERM, TZ from the appliance (plus the
names in ``passthrough_env``), HOME and TMPDIR inside the rollout directory, the rollout's
endpoint under the names agents already read (``OPENAI_BASE_URL``, ``OPENAI_API_BASE``,
``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` = the base URL without ``/v1``,
``ANTHROPIC_API_KEY``), ``LA_MODEL``, ``LA_ROLLOUT_ID``, ``LA_REWARD_URL``, ``LA_REWARD_FILE``,
``LA_WORKDIR``, ``TASK_JSON``, ``TASK_ID``, ``TASK_<FIELD>``, and ``env`` from the config.
Verifiers get the same without the model's URL and key.

How the rollout ends: a nonzero exit is ``AgentFailed`` with the tail of the agent's stderr;
an executable that is not there, or a rollout directory that cannot be made, is
``InfraError``; otherwise the reward is the verifier's, else the reward function's, else what
the agent wrote to ``$LA_REWARD_FILE``, else ``None`` (the agent POSTed it, or gave none).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harness_adapters.base import DETAIL_CHARS, AgentFailed, ClientConfig, InfraError, Task
from harness_adapters.gitrepos import commit_store
from harness_adapters.lifecycle import Slots
from harness_adapters.loading import load_object
from harness_adapters.process import ProcessResult, ResourceLimits, run_process, scrubbed_env
from harness_adapters.relay import EndpointRelay
from harness_adapters.rewards import (
    RewardFile,
    RewardFn,
    RewardFrom,
    RewardFunction,
    RewardSource,
    VerifierCommand,
    VerifyContext,
)
from harness_adapters.sandbox import Confinement, Endpoint, Sandbox, SandboxKind, SandboxLimits
from harness_adapters.swebench import CodingTests, SweBenchInstance, is_swebench, prepare_workdir
from harness_adapters.templates import render_argv, split_command, task_env, template_values
from harness_adapters.workdir import (
    KeepPolicy,
    RolloutDir,
    create_rollout_dir,
    default_root,
    release_rollout_dir,
)

MB = 1024 * 1024


class ProcessOptions(BaseModel):
    """How every process of a rollout runs (shared by the process-based adapters)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the agent (values may use ``{field}`` placeholders, and
    ``{api_key}``, the rollout's key, for a harness that reads it under another name)."""
    passthrough_env: list[str] = Field(default_factory=list)
    """Names of variables copied from the appliance's own environment (e.g. a license key)."""
    home_files: dict[str, Path] = Field(default_factory=dict)
    """Copied into the rollout's fresh HOME before the agent starts: path inside HOME -> a file
    or directory (``~`` expands), e.g. ``{".config/mini-swe-agent" = "~/.config/mini-swe-agent"}``,
    so a harness finds its own config there. Each rollout gets its own copy."""
    python_on_path: bool = True
    """Put the appliance's Python first on PATH, so ``python`` is the interpreter it runs on."""
    workdir_root: Path | None = None
    """Where rollout directories are made (default: ``$TMPDIR/lightning-appliance/rollouts``)."""
    repo_field: str = "repo"
    """Task field naming a directory or archive to copy in as the working directory."""
    repos_dir: Path | None = None
    """Where the git mirrors of SWE-bench instances are (``owner__name.git``): such a task's
    working directory is its repository at ``base_commit`` (a task's own ``repos_dir`` wins)."""
    keep_workdirs: KeepPolicy = "failed"
    """Which rollout directories stay after the rollout: never, failed ones, or always."""
    memory_mb: int | None = None
    """Address-space limit of each process in MiB (RLIMIT_AS)."""
    cpu_seconds: int | None = None
    """CPU-time limit of each process in seconds (RLIMIT_CPU)."""
    file_size_mb: int | None = None
    """Largest file a process may write, in MiB (RLIMIT_FSIZE)."""
    open_files: int | None = None
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    kill_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when a rollout is stopped."""
    max_concurrency: int | None = Field(default=None, ge=1)
    """Most agents of this adapter running at once (None: no limit of its own)."""
    sandbox: SandboxKind = "none"
    """Where every process of a rollout runs: ``bwrap`` (bubblewrap: its own namespaces, only
    its rollout directory writable, no network but its endpoint), ``container`` (the task's
    ``image_name`` under ``container_runtime``), or ``none`` (on the host, as the appliance's
    user). The appliance sets it from ``[harness] sandbox``."""
    allow_network: bool = False
    """Let sandboxed processes reach the network as the appliance can (a task set that needs it)."""
    sandbox_memory_mb: int | None = Field(default=None, ge=16)
    """Memory of the whole rollout in MiB (control group; else RLIMIT_AS per process)."""
    sandbox_processes: int | None = Field(default=None, ge=4)
    """Processes and threads of the whole rollout at once."""
    sandbox_cpus: float | None = Field(default=None, gt=0)
    """CPUs' worth of time the whole rollout may use (control group quota)."""
    sandbox_disk_mb: int | None = Field(default=None, ge=1)
    """Disk the rollout's directory may take in MiB, and the size of its ``/tmp``."""
    read_only_paths: list[Path] = Field(default_factory=list)
    """More host paths a sandboxed rollout sees, read-only (an agent's own code)."""
    hidden_paths: list[Path] = Field(default_factory=list)
    """Host paths a sandboxed rollout never sees (the appliance adds its data directory)."""
    container_runtime: str = "podman"
    """``sandbox = "container"``: ``podman`` or ``docker``."""
    image: str | None = None
    """``sandbox = "container"``: the image for tasks that name no ``image_name``."""

    def sandbox_policy(self) -> Sandbox:
        return Sandbox(
            kind=self.sandbox,
            allow_network=self.allow_network,
            limits=SandboxLimits(
                memory_mb=self.sandbox_memory_mb,
                processes=self.sandbox_processes,
                cpus=self.sandbox_cpus,
                disk_mb=self.sandbox_disk_mb,
            ),
            read_only=tuple(p.expanduser().resolve() for p in self.read_only_paths),
            hidden=tuple(p.expanduser().resolve() for p in self.hidden_paths),
            runtime=self.container_runtime,
            image=self.image,
        )

    def limits(self) -> ResourceLimits:
        return ResourceLimits(
            address_space_bytes=self.memory_mb * MB if self.memory_mb else None,
            cpu_seconds=self.cpu_seconds,
            file_size_bytes=self.file_size_mb * MB if self.file_size_mb else None,
            open_files=self.open_files,
        )


class CommandConfig(ProcessOptions):
    """The ``command`` adapter's configuration."""

    command: str | list[str]
    """The agent's command: a string (split like a shell would, never run by one) or an argv."""
    verifier: str | list[str] | None = None
    """A command run after the agent, in its working directory, whose result is the reward."""
    verifier_timeout_s: float = 300.0
    """Seconds the verifier may run (past it, the reward is 0.0)."""
    reward_from: RewardFrom = "auto"
    """How the verifier gives the reward: ``exit_code``, ``stdout`` (last line) or ``auto``."""
    reward_function: str | None = None
    """``module:function(task, workdir) -> float``, used when there is no verifier."""
    task_tests: bool = False
    """Reward from the task's own tests (before any verifier): a SWE-bench instance's FAIL_TO_PASS
    and PASS_TO_PASS on the agent's diff in a fresh checkout, a coding task's ``test_cmd``."""
    scoring: Literal["binary", "fraction"] = "binary"
    """``task_tests`` of a SWE-bench instance: 1.0 iff all pass, or the share that pass."""
    tests_timeout_s: float = 300.0
    """Seconds the task's tests may run (past it, the reward is 0.0)."""


def endpoint_env(client: ClientConfig) -> dict[str, str]:
    """The rollout's endpoint under the variable names agents already read."""
    anthropic_base = client.base_url.removesuffix("/").removesuffix("/v1")
    return {
        "OPENAI_BASE_URL": client.base_url,
        "OPENAI_API_BASE": client.base_url,
        "OPENAI_API_KEY": client.api_key,
        "ANTHROPIC_BASE_URL": anthropic_base,
        "ANTHROPIC_API_KEY": client.api_key,
        "LA_MODEL": client.model,
        "LA_REWARD_URL": client.reward_url,
        "NO_PROXY": "127.0.0.1,localhost,::1",
    }


class CommandAdapter:
    """Runs ``config.command`` once per rollout; see the module docstring."""

    name = "command"

    def __init__(
        self,
        config: CommandConfig | None = None,
        /,
        *,
        reward_sources: Sequence[RewardSource] | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise TypeError("pass either a CommandConfig or options, not both")
        self.config = config if config is not None else CommandConfig(**options)
        self.argv = split_command(self.config.command)
        self._limits = self.config.limits()
        self._root = self.config.workdir_root or default_root()
        self._slots = Slots(self.config.max_concurrency)
        self.sandbox = self.config.sandbox_policy()
        self.reward_sources: list[RewardSource] = (
            list(reward_sources) if reward_sources is not None else self._configured_rewards()
        )

    def _configured_rewards(self) -> list[RewardSource]:
        sources: list[RewardSource] = []
        if self.config.task_tests:
            c = self.config
            sources.append(CodingTests(c.tests_timeout_s, scoring=c.scoring, repos_dir=c.repos_dir))
        if self.config.verifier is not None:
            verifier_argv = split_command(self.config.verifier)

            def render(task: Task, rdir: RolloutDir) -> list[str]:
                return render_argv(verifier_argv, self._values(task, None, rdir), task_id=task.id)

            sources.append(VerifierCommand(render, self.config.verifier_timeout_s, self.config.reward_from))
        if self.config.reward_function is not None:
            fn: RewardFn = load_object(self.config.reward_function, what="reward function")
            sources.append(RewardFunction(fn))
        sources.append(RewardFile())
        return sources

    # --- what the agent gets -------------------------------------------------------------------

    def _values(self, task: Task, client: ClientConfig | None, rdir: RolloutDir) -> dict[str, str]:
        builtins = {
            "task_id": task.id,
            "workdir": str(rdir.work),
            "rollout_dir": str(rdir.root),
            "task_json": str(rdir.task_json),
        }
        if client is not None:
            builtins |= {
                "rollout_id": client.rollout_id,
                "model": client.model,
                "base_url": client.base_url,
                "reward_url": client.reward_url,
            }
        return template_values(task, builtins)

    def _env(self, task: Task, client: ClientConfig | None, rdir: RolloutDir) -> dict[str, str]:
        """The agent's environment (``client`` given) or a verifier's (``client`` None)."""
        extra = task_env(task)
        extra |= {
            "TMPDIR": str(rdir.tmp),
            "TASK_JSON": str(rdir.task_json),
            "LA_WORKDIR": str(rdir.work),
            "LA_REWARD_FILE": str(rdir.reward_file),
        }
        if client is not None:
            extra |= endpoint_env(client) | {"LA_ROLLOUT_ID": client.rollout_id}
            # The key only here, never in an argv (which any process on the machine can read).
            values = self._values(task, client, rdir) | {"api_key": client.api_key}
            extra |= {k: render_argv([v], values, task_id=task.id)[0] for k, v in self.config.env.items()}
        env = scrubbed_env(extra, passthrough=self.config.passthrough_env, home=rdir.home)
        if self.config.python_on_path:
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        return env

    def agent_argv(self, task: Task, client: ClientConfig, rdir: RolloutDir) -> list[str]:
        return render_argv(self.argv, self._values(task, client, rdir), task_id=task.id)

    def snapshot(self, task: Task) -> Path | None:
        """The directory or archive to copy in as the working directory, if the task names one."""
        value = task.data.get(self.config.repo_field)
        if not value or is_swebench(task):  # checked out from its mirror instead (``_run``)
            return None
        path = Path(str(value)).expanduser()
        if not path.exists():
            raise InfraError(f"task {task.id!r}: {self.config.repo_field} {str(path)!r} does not exist")
        return path

    # --- one rollout ---------------------------------------------------------------------------

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        async with self._slots:
            return await self._run(task, client)

    async def _run(self, task: Task, client: ClientConfig) -> float | None:
        rdir = await create_rollout_dir(
            self._root,
            task,
            client.rollout_id,
            source=self.snapshot(task),
            home_files={k: v.expanduser() for k, v in self.config.home_files.items()},
        )
        failed = True
        try:
            sandbox = await asyncio.to_thread(self._prepare, task, rdir)
            async with self._endpoint(client) as endpoint:
                if endpoint is not None:  # the URLs as the agent reaches them inside
                    client = dataclasses.replace(
                        client,
                        base_url=endpoint.url(client.base_url),
                        reward_url=endpoint.url(client.reward_url),
                    )
                result = await run_process(
                    self.agent_argv(task, client, rdir),
                    cwd=rdir.work,
                    env=self._env(task, client, rdir),
                    stdout_path=rdir.log("agent", "stdout"),
                    stderr_path=rdir.log("agent", "stderr"),
                    limits=self._limits,
                    grace_s=self.config.kill_grace_s,
                    confinement=self._confinement(sandbox, task, client.rollout_id, rdir, endpoint),
                )
            self.check_agent(result, rdir)
            reward = await self.reward(task, rdir, sandbox=sandbox)
            failed = False
            return reward
        finally:
            await release_rollout_dir(rdir, failed=failed, keep=self.config.keep_workdirs)

    @contextlib.asynccontextmanager
    async def _endpoint(self, client: ClientConfig) -> AsyncIterator[Endpoint | None]:
        """The rollout's endpoint as its sandbox reaches it: the proxy's own socket for the
        rollout, else a relay to its URL; None where the rollout is not sandboxed or has the
        network."""
        if not self.sandbox.confined or self.sandbox.allow_network:
            yield None
        elif client.endpoint_socket is not None:
            yield Endpoint.for_url(Path(client.endpoint_socket), client.base_url)
        else:
            async with EndpointRelay.open(client.base_url) as socket:
                yield Endpoint.for_url(socket, client.base_url)

    def _prepare(self, task: Task, rdir: RolloutDir) -> Sandbox:
        """The working copy of a SWE-bench instance checked out, and the rollout's sandbox: the
        adapter's, with such a checkout's commit store readable (blocking: once per rollout)."""
        if not prepare_workdir(task, rdir.work, repos_dir=self.config.repos_dir):
            return self.sandbox
        instance = SweBenchInstance.from_task(task)
        store = commit_store(instance.mirror(self.config.repos_dir), instance.base_commit)
        return dataclasses.replace(self.sandbox, read_only=(*self.sandbox.read_only, store))

    def _confinement(
        self, sandbox: Sandbox, task: Task, name: str, rdir: RolloutDir, endpoint: Endpoint | None
    ) -> Confinement | None:
        if not sandbox.confined:
            return None
        image = task.data.get("image_name") if isinstance(task.data.get("image_name"), str) else None
        return Confinement(sandbox, writable=rdir.root, endpoint=endpoint, name=name, image=image)

    def check_agent(self, result: ProcessResult, rdir: RolloutDir) -> None:
        """Raise ``AgentFailed`` (with the stderr tail) unless the agent ended normally."""
        if result.returncode != 0:
            detail = result.stderr_tail(DETAIL_CHARS) or result.stdout_tail(DETAIL_CHARS)
            raise AgentFailed(f"agent {result.describe()}", detail=detail)

    async def reward(self, task: Task, rdir: RolloutDir, *, sandbox: Sandbox | None = None) -> float | None:
        """The first reward a reward source gives (the verifier's before the agent's own), each
        verifier in ``sandbox`` (default: the adapter's)."""
        box = sandbox or self.sandbox
        ctx = VerifyContext(
            rdir,
            self._env(task, None, rdir),
            self._limits,
            self.config.kill_grace_s,
            confine=lambda where, name: self._confinement(box, task, name, where, None),
        )
        try:
            for source in self.reward_sources:
                reward = await source.reward(task, ctx)
                if reward is not None:
                    return reward
        except InfraError as exc:
            # The agent already ran: retrying would run it again on top of its recorded calls.
            raise InfraError(exc.reason, started=True) from exc
        return None
