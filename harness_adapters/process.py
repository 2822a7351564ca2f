"""Agent processes: start one under the launcher, wait for it, and stop its whole tree.

Owns ``run_process`` and everything about a child process's life: the executable looked up on
the PATH it will get (a missing one is an ``InfraError``, before anything starts), stdout and
stderr written to files, resource limits, a wall-clock limit, and stopping. It knows nothing
about tasks, URLs or rewards; adapters decide what to run and with which environment.

Invariant: when ``run_process`` returns or raises (including ``CancelledError``), no process it
started is running. Each command runs under ``_launcher.py`` as the leader of a new session; the
launcher is a child subreaper that kills and reaps every descendant when the agent exits. To
stop early, the whole process group gets SIGTERM, the agent ``grace_s`` seconds to exit, and
then every descendant gets SIGKILL (from the launcher, or, if the launcher itself does not
answer, from here by walking ``/proc``).

In a sandbox (``confinement``) the command is ``bwrap`` (or the container runtime), started,
where the rollout has a control group (``cgroups``: memory, processes and CPU of the whole
rollout), by a shell that first joins it (``JOIN_AND_EXEC``); inside, the launcher, as the first
process of the sandbox's PID namespace, applies the per-process limits, relays the rollout's
endpoint and starts the command (``sandbox``). When it exits the kernel ends every process left
in the namespace. A sandboxed run is stopped at once: the SIGTERM that reaches ``bwrap`` ends
it, and ``--die-with-parent`` takes the namespace with it (no grace period). A watchdog
(``watch``) ends the run when a rollout-wide limit is reached (the kernel refused a fork or
killed for memory; the rollout's directory past its disk limit; where no control group could be
made, more processes than allowed), and the result names that limit (``ProcessResult.breach``).

In-process Python agents that start subprocesses should use ``run_process`` too: cancelling
the agent's coroutine then stops the subprocess tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from harness_adapters import _launcher, cgroups
from harness_adapters.base import InfraError
from harness_adapters.sandbox import CONTAINER_LAUNCHER, INNER_SOCKET, Confinement, bwrap_argv, container_argv
from harness_adapters.watch import Watchdog

LAUNCHER = Path(_launcher.__file__).resolve()
#: This interpreter without ``..`` and such (links kept: a venv's ``python`` is a link, and the
#: venv is found from the link's path): the path a sandbox binds.
PYTHON = os.path.normpath(os.path.abspath(sys.executable))  # noqa: PTH100 (no resolving)
#: Environment variables passed through from the appliance's own environment by default.
BASE_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ")


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Per-process limits (``setrlimit``) for the agent and each process it starts."""

    #: Virtual memory per process in bytes (RLIMIT_AS); None: unlimited.
    address_space_bytes: int | None = None
    #: CPU seconds per process (RLIMIT_CPU; SIGXCPU when exceeded); None: unlimited.
    cpu_seconds: int | None = None
    #: Largest file a process may write, in bytes (RLIMIT_FSIZE); None: unlimited.
    file_size_bytes: int | None = None
    #: Open file descriptors per process (RLIMIT_NOFILE); None: inherited.
    open_files: int | None = None

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """``RLIMIT_*`` name -> (soft, hard). CPU gets one second more hard than soft, so the
        agent first gets SIGXCPU (a nameable reason) and only then SIGKILL."""
        named = {
            "RLIMIT_AS": self.address_space_bytes,
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_FSIZE": self.file_size_bytes,
            "RLIMIT_NOFILE": self.open_files,
        }
        return {
            name: (value, value + 1 if name == "RLIMIT_CPU" else value)
            for name, value in named.items()
            if value is not None
        }


@dataclass(frozen=True, slots=True)
class ProcessResult:
    returncode: int
    stdout_path: Path
    stderr_path: Path
    duration_s: float
    #: True if ``timeout_s`` ran out and the tree was stopped.
    timed_out: bool = False
    #: The rollout-wide limit that ended the run, in words (``process limit reached (64
    #: processes)``); None if none did.
    breach: str | None = None

    def stdout_tail(self, limit: int = 4000) -> str:
        return read_tail(self.stdout_path, limit)

    def stderr_tail(self, limit: int = 4000) -> str:
        return read_tail(self.stderr_path, limit)

    def describe(self) -> str:
        """``exit code 3``, ``exit code 137 (SIGKILL)``, ``timed out after 5 s``, or the limit
        that ended it (``memory limit reached (512 MiB)``)."""
        if self.breach is not None:
            return f"stopped: {self.breach}"
        if self.timed_out:
            return f"timed out after {self.duration_s:.3g} s"
        return describe_exit(self.returncode)


def describe_exit(code: int) -> str:
    if code == 127:
        return "exit code 127 (command not found or could not start)"
    if code > 128:
        with contextlib.suppress(ValueError):
            name = signal.Signals(code - 128).name
            hint = {"SIGXCPU": ": CPU time limit", "SIGXFSZ": ": file size limit"}.get(name, "")
            return f"exit code {code} ({name}{hint})"
    return f"exit code {code}"


def read_tail(path: Path, limit: int) -> str:
    """The last ``limit`` bytes of a file as text ('' if it does not exist)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            data = handle.read()
    except OSError:
        return ""
    text = data.decode(errors="replace").rstrip()
    return "..." + text if size > limit else text


def scrubbed_env(
    extra: Mapping[str, str], *, passthrough: Sequence[str] = (), home: Path | None = None
) -> dict[str, str]:
    """A fresh environment: the base variables and ``passthrough`` from ours, then ``extra``."""
    env = {name: os.environ[name] for name in (*BASE_ENV, *passthrough) if name in os.environ}
    env.setdefault("PATH", os.defpath)
    env.setdefault("LANG", "C.UTF-8")
    env["HOME"] = str(home) if home is not None else os.environ.get("HOME", "/")
    env.update(extra)
    return env


def resolve_executable(argv0: str, env: Mapping[str, str], cwd: Path) -> str:
    """The path of ``argv0`` as the child would find it; ``InfraError`` if it is not there."""
    if os.sep in argv0:
        path = Path(argv0) if Path(argv0).is_absolute() else cwd / argv0
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        raise InfraError(f"executable not found or not executable: {argv0!r}")
    found = shutil.which(argv0, path=env.get("PATH", os.defpath))
    if found is None:
        raise InfraError(f"executable {argv0!r} not found on PATH={env.get('PATH', '')!r}")
    return found


def _signal_group(process: asyncio.subprocess.Process, signum: int) -> None:
    # Only while the launcher is not reaped: its pid (= the group id) is ours until then.
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)


def _kill_now(process: asyncio.subprocess.Process) -> None:
    _launcher.kill_tree(process.pid, include_root=True)
    _signal_group(process, signal.SIGKILL)


async def _stop(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the group, let the launcher clean up, SIGKILL the tree if it does not."""
    _signal_group(process, signal.SIGTERM)
    try:
        # The launcher kills what is left ``grace_s`` after the SIGTERM; allow it a moment more.
        await asyncio.wait_for(process.wait(), grace_s + 2.0)
        return
    except TimeoutError:
        pass
    except BaseException:
        # Cancelled again while waiting (e.g. the appliance stopping): no more grace.
        _kill_now(process)
        raise
    _kill_now(process)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), 5.0)


def _log_file(path: Path) -> BinaryIO:
    """A new file at ``path`` for a process's output. What was there goes first, unfollowed: a
    verifier's log lies in a directory the agent could write, where it may have left a link to
    a file of the host's."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def _spec(**fields: object) -> str:
    return json.dumps({key: value for key, value in fields.items() if value is not None})


def _confined_argv(
    confinement: Confinement,
    executable: str,
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    limits: ResourceLimits,
    grace_s: float,
    group: cgroups.Group | None,
) -> list[str]:
    """The launcher outside (joining ``group``), the sandbox, and the launcher inside."""
    sandbox = confinement.sandbox
    rlimits = limits.rlimits()
    if group is None and sandbox.limits.memory_mb is not None and "RLIMIT_AS" not in rlimits:
        # No control group here: the rollout's memory bounds each process instead.
        size = sandbox.limits.memory_mb * 1024 * 1024
        rlimits["RLIMIT_AS"] = (size, size)
    endpoint = confinement.endpoint
    forward = (
        {"host": endpoint.host, "port": endpoint.port, "unix": INNER_SOCKET} if endpoint is not None else None
    )
    if sandbox.kind == "container":
        inner = ["python3", "-I", "-S", CONTAINER_LAUNCHER]
        inner += [_spec(limits=rlimits, grace_s=grace_s, forward=forward, namespace=True), *argv]
        command = container_argv(confinement, inner, cwd=cwd, env=env)
    else:
        inner = [PYTHON, "-I", "-S", str(LAUNCHER)]
        inner += [
            _spec(limits=rlimits, grace_s=grace_s, forward=forward, namespace=True),
            executable,
            *argv[1:],
        ]
        command = bwrap_argv(confinement, inner, cwd=cwd)
    if group is None:
        return command
    # Into the control group, then become the sandbox: a shell does it in a millisecond, where
    # an interpreter would take ten.
    files = group.procs_files()
    return ["/bin/sh", "-c", JOIN_AND_EXEC, "join", str(len(files)), *files, *command]


#: ``sh -c JOIN_AND_EXEC join N FILE... COMMAND...``: write this shell's pid to each of the N
#: files (``cgroup.procs``), then exec COMMAND (in the groups; its children are too).
JOIN_AND_EXEC = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 127; shift; n=$((n-1)); done; exec "$@"'
)


def _make_group(confinement: Confinement | None) -> cgroups.Group | None:
    """The run's control group, where one can be made and the sandbox has limits for it."""
    if confinement is None or confinement.sandbox.kind != "bwrap":
        return None
    wanted = confinement.sandbox.limits
    limits = cgroups.GroupLimits(
        memory_bytes=wanted.memory_mb * 1024 * 1024 if wanted.memory_mb is not None else None,
        processes=wanted.processes,
        cpus=wanted.cpus,
    )
    found = cgroups.find() if limits.any() else None
    if found is None:
        return None
    try:
        return found.create(f"{confinement.name}-{os.urandom(3).hex()}", limits)
    except OSError as exc:
        raise InfraError(f"could not make the rollout's control group: {exc}") from exc


async def run_process(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdout_path: Path,
    stderr_path: Path,
    limits: ResourceLimits | None = None,
    grace_s: float = 5.0,
    timeout_s: float | None = None,
    confinement: Confinement | None = None,
) -> ProcessResult:
    """Run ``argv`` to its end (or ``timeout_s``, or a rollout-wide limit); stopping its whole
    tree if cancelled. ``confinement``: run it in that sandbox (``none`` runs it as it is)."""
    if not argv:
        raise ValueError("empty command")
    if confinement is not None and not confinement.sandbox.confined:
        confinement = None
    in_container = confinement is not None and confinement.sandbox.kind == "container"
    executable = argv[0] if in_container else resolve_executable(argv[0], env, cwd)
    group = await asyncio.to_thread(_make_group, confinement)
    if confinement is not None:
        command = _confined_argv(
            confinement,
            executable,
            argv,
            cwd=cwd,
            env=env,
            limits=limits or ResourceLimits(),
            grace_s=grace_s,
            group=group,
        )
    else:
        spec = _spec(limits=(limits or ResourceLimits()).rlimits(), grace_s=grace_s)
        command = [PYTHON, "-I", "-S", str(LAUNCHER), spec, executable, *argv[1:]]
    started = time.perf_counter()
    try:
        try:
            with _log_file(stdout_path) as stdout, _log_file(stderr_path) as stderr:
                process = await asyncio.create_subprocess_exec(
                    # -I: isolated (no PYTHON* variables, no user site, no script dir on sys.path)
                    *command,
                    cwd=cwd,
                    env=dict(env),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                )
        except OSError as exc:
            raise InfraError(f"could not start {argv[0]!r}: {exc}") from exc
        watchdog = Watchdog.start(
            process.pid,
            group=group,
            sandbox=confinement.sandbox.limits if confinement is not None else None,
            disk_root=confinement.writable if confinement is not None else None,
            stop=lambda: _kill_now(process),
        )
        timed_out = False
        try:
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
                await _stop(process, grace_s)
        except BaseException:
            # Cancelled (the rollout's timeout, or the appliance stopping): stop the tree first.
            if process.returncode is None:
                await _stop(process, grace_s)
            raise
        finally:
            breach = await watchdog.close()
    finally:
        if group is not None:
            await asyncio.to_thread(group.close)
    return ProcessResult(
        returncode=process.returncode if process.returncode is not None else -1,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
        duration_s=time.perf_counter() - started,
        timed_out=timed_out and breach is None,
        breach=breach,
    )
