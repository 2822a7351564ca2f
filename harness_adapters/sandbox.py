"""Sandboxes: what a rollout's processes can see, reach and use, and the command that says so.

Owns the confinement of one rollout's processes (its agent, and each verifier after it), as a
command line around the launcher: ``bwrap`` (bubblewrap) or a container runtime (``podman`` /
``docker run``), and the probe that tells whether bubblewrap runs here. It knows nothing about
tasks, rewards or the proxy; ``process.run_process`` runs what it builds.

Under ``bwrap`` a rollout's processes get new user, PID, IPC, UTS, cgroup and (unless the task
set allows it) network namespaces, and a file system of their own:

* read-only: the host's system directories (``/usr`` and the ``/bin``, ``/lib*`` links), a few
  files of ``/etc`` (name resolution, the dynamic linker, certificates, time zone; a
  ``passwd`` naming the sandbox's user, not the host's), the Python the agent runs on (the
  appliance's venv and its base installation), the packages a harness imports from this project
  (``harness_adapters``, ``contracts``), and what the config adds (``read_only``);
* writable: the rollout's own directory only (``work/``, ``home/``, ``tmp/``, its logs);
* ``/proc`` of its own PID namespace, a minimal ``/dev``, a size-limited ``/tmp``;
* absent: the data directory (the event log, the admin token, checkpoints, the model), the
  appliance's other source and its vLLM venv, other rollouts' directories, the user's home.
  ``hidden`` paths are covered by an empty tmpfs even where a ``read_only`` path holds them;
* the network: none but the rollout's endpoint. The proxy serves each rollout on a Unix
  socket of its own (``Endpoint.socket``, bound at ``INNER_SOCKET``); inside, the launcher
  listens on the loopback address and port the rollout's URL names and forwards each connection
  to that socket, so ``OPENAI_BASE_URL`` works unchanged and nothing else is reachable.

Every process runs as uid/gid ``SANDBOX_UID`` without capabilities, may not make user
namespaces of its own, and dies with the sandbox (``--die-with-parent``; the PID namespace ends
when its first process does, so no daemon survives the rollout).
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import contracts
import harness_adapters
from harness_adapters import _launcher

SandboxKind = Literal["bwrap", "container", "none"]
#: What the config may say; ``auto`` is resolved once at start (``resolve_kind``).
SandboxSetting = Literal["auto", "bwrap", "container", "none"]
SANDBOX_UID = 1000
#: Where the rollout's endpoint socket appears inside the sandbox.
INNER_SOCKET = "/run/appliance/endpoint.sock"
#: Where the launcher appears inside a container (it runs on the image's ``python3``).
CONTAINER_LAUNCHER = "/run/appliance/launcher.py"
#: A URL's port under 1024 is relayed inside on this much more (the sandbox's user may not bind it).
LOW_PORT_SHIFT = 10000
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The parts of /etc a program needs to run (and nothing that holds a secret).
ETC_FILES = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "gai.conf",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "protocols",
    "resolv.conf",
    "services",
    "ssl",
    "timezone",
)
MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one rollout as a whole (all its processes together)."""

    #: Memory in MiB, swap included (cgroup; else RLIMIT_AS per process).
    memory_mb: int | None = None
    #: Processes (and threads) at once (cgroup ``pids.max``; else counted by a watchdog).
    processes: int | None = None
    #: CPUs' worth of time (cgroup CPU quota; e.g. 1.5), None: no cap.
    cpus: float | None = None
    #: Disk the rollout's directory may take, in MiB (a watchdog sums it), and the size of its
    #: ``/tmp`` (a tmpfs).
    disk_mb: int | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The rollout's model endpoint as a sandbox offers it: a Unix socket on the host that
    serves this rollout only, and the loopback address and port its URL names."""

    socket: Path
    host: str
    port: int

    @classmethod
    def for_url(cls, socket: Path, base_url: str) -> Endpoint:
        """Where the relay inside listens for ``base_url``: its host and port, but a port under
        1024 (which the sandbox's unprivileged user may not listen on) moved up by
        ``LOW_PORT_SHIFT`` (``url`` gives the URL the agent is then told)."""
        host, port = host_and_port(base_url)
        return cls(socket, listen_host(host), port + LOW_PORT_SHIFT if port < 1024 else port)

    def url(self, url: str) -> str:
        """``url`` as the agent reaches it inside: the same, with the port the relay listens on."""
        parts = urlsplit(url)
        if parts.port == self.port:
            return url
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
        return urlunsplit(parts._replace(netloc=f"{host}:{self.port}"))


def host_and_port(url: str) -> tuple[str, int]:
    """The host and port ``url`` names (its scheme's port when it gives none)."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def listen_host(host: str) -> str:
    """Where the in-sandbox forwarder listens for a URL naming ``host``: the address itself
    when it is a loopback or wildcard address, else 127.0.0.1."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "127.0.0.1"
    return host if address.is_loopback or address.is_unspecified else "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How every process of a rollout is confined (the policy; ``Confinement`` adds one run's
    paths)."""

    kind: SandboxKind = "none"
    #: Let the rollout reach the network as the appliance can (a task set that needs it).
    allow_network: bool = False
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    #: More host paths visible read-only (an agent's own code, a dataset).
    read_only: tuple[Path, ...] = ()
    #: Host paths never visible, even inside a ``read_only`` one (the data directory).
    hidden: tuple[Path, ...] = ()
    #: ``container``: the runtime (``podman`` or ``docker``) and the image when the task names
    #: none (its ``image_name``).
    runtime: str = "podman"
    image: str | None = None

    @property
    def confined(self) -> bool:
        return self.kind != "none"

    def describe(self) -> str:
        """One line for the startup banner, ``status`` and ``doctor``."""
        if self.kind == "none":
            return "agents run unsandboxed"
        network = "network allowed" if self.allow_network else "no network but the rollout's endpoint"
        return f"agents run sandboxed ({self.kind}; {network})"


@dataclass(frozen=True, slots=True)
class Confinement:
    """One process's run in a sandbox: the policy and the run's own paths."""

    sandbox: Sandbox
    #: The one writable directory (the rollout's, or a verifier's fresh one).
    writable: Path
    #: The rollout's endpoint; None: no model endpoint (a verifier).
    endpoint: Endpoint | None = None
    #: A name for the run's control group or container (the rollout id and the step).
    name: str = "rollout"
    #: The container image for this run (the task's ``image_name``), else the sandbox's.
    image: str | None = None


def _shown(sandbox: Sandbox) -> list[Path]:
    """Every host path a sandbox sees read-only: the Python, the project's packages, its own."""
    return [*_python_roots(), *_project_packages(), *sandbox.read_only]


@functools.cache
def _python_roots() -> list[Path]:
    """The Python installation the agent runs on: the venv and the base it was made from."""
    roots = {
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
        Path(sys.executable).resolve().parent.parent,
    }
    return sorted(r for r in roots if not any(r.is_relative_to(d) for d in ("/usr", "/bin", "/lib")))


@functools.cache
def _project_packages() -> list[Path]:
    """The project packages a harness may import (example agents, the python worker)."""
    return [Path(harness_adapters.__file__).resolve().parent, Path(contracts.__file__).resolve().parent]


@functools.cache
def _etc_dir() -> Path:
    """A directory holding the sandbox's ``passwd`` and ``group`` (made once per process)."""
    directory = Path(tempfile.mkdtemp(prefix="lightning-appliance-etc-"))
    atexit.register(shutil.rmtree, directory, True)
    (directory / "passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\nagent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:/tmp:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (directory / "group").write_text(f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
    for name in ("passwd", "group"):
        (directory / name).chmod(0o644)
    directory.chmod(0o755)
    return directory


def _bind_system(args: list[str]) -> None:
    for path in map(Path, SYSTEM_DIRS):
        if path.is_symlink():
            args += ["--symlink", str(path.readlink()), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    etc = _etc_dir()
    args += ["--ro-bind", str(etc / "passwd"), "/etc/passwd", "--ro-bind", str(etc / "group"), "/etc/group"]


def bwrap_argv(run: Confinement, inner: Sequence[str], *, cwd: Path, bwrap: str = "bwrap") -> list[str]:
    """The ``bwrap`` command that runs ``inner`` (the launcher and the agent) confined."""
    sandbox = run.sandbox
    args = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent"]
    args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    if not sandbox.allow_network:
        args.append("--unshare-net")
    _bind_system(args)
    args += ["--proc", "/proc", "--dev", "/dev"]
    if sandbox.limits.disk_mb is not None:
        args += ["--size", str(sandbox.limits.disk_mb * MB)]
    # The empty /tmp first: a path bound below may lie under it (pytest's, a user's scratch).
    args += ["--tmpfs", "/tmp", "--tmpfs", "/run"]
    for path in _shown(sandbox):
        args += ["--ro-bind-try", str(path), str(path)]
    for path in sandbox.hidden:
        args += ["--tmpfs", str(path)]
    args += ["--bind", str(run.writable), str(run.writable)]
    if run.endpoint is not None:
        args += ["--bind", str(run.endpoint.socket), INNER_SOCKET]
    # The root that bwrap built (a tmpfs holding the mount points) read-only from here on.
    args += ["--remount-ro", "/", "--chdir", str(cwd), "--", *inner]
    return args


def container_argv(
    run: Confinement, inner: Sequence[str], *, cwd: Path, env: Mapping[str, str], runtime: str | None = None
) -> list[str]:
    """The ``podman run`` / ``docker run`` command that runs ``inner`` in the task's image with
    the same mounts, network and limits as ``bwrap_argv``."""
    sandbox = run.sandbox
    image = run.image or sandbox.image
    if not image:
        raise ValueError("sandbox 'container' needs an image: the task's image_name or the adapter's image")
    limits = sandbox.limits
    name = f"{_container_name(run.name)}-{os.urandom(3).hex()}"
    args = [runtime or sandbox.runtime, "run", "--rm", "--init", "--name", name]
    args += ["--network", "host" if sandbox.allow_network else "none"]
    # The appliance's own user inside (its rollout directory is owner-only), no capabilities.
    uid, gid = os.getuid(), os.getgid()
    if uid != 0:
        args += ["--userns", "keep-id"]
    args += ["--user", f"{uid}:{gid}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if limits.memory_mb is not None:
        args += ["--memory", f"{limits.memory_mb}m", "--memory-swap", f"{limits.memory_mb}m"]
    if limits.processes is not None:
        args += ["--pids-limit", str(limits.processes)]
    if limits.cpus is not None:
        args += ["--cpus", f"{limits.cpus:g}"]
    tmp = "/tmp:rw,exec" + (f",size={limits.disk_mb}m" if limits.disk_mb is not None else "")
    args += ["--tmpfs", tmp]
    for path in _shown(sandbox):
        if path.exists():
            args += ["-v", f"{path}:{path}:ro"]
    # A hidden path under a read-only bind is covered by an empty directory of the rollout's own
    # (the runtime mounts parents first; a tmpfs there would not cover the bind, and a read-only
    # cover would leave no room for the mount points under it).
    shown = _shown(sandbox)
    for i, path in enumerate(p for p in sandbox.hidden if any(p.is_relative_to(r) for r in shown)):
        cover = run.writable / ".hidden" / str(i)
        cover.mkdir(parents=True, exist_ok=True)
        args += ["-v", f"{cover}:{path}:rw"]
    args += ["-v", f"{Path(_launcher.__file__).resolve()}:{CONTAINER_LAUNCHER}:ro"]
    args += ["-v", f"{run.writable}:{run.writable}:rw"]
    if run.endpoint is not None:
        args += ["-v", f"{run.endpoint.socket}:{INNER_SOCKET}"]
    for name, value in sorted(env.items()):
        args += ["-e", f"{name}={value}"]
    args += ["-w", str(cwd), image, *inner]
    return args


def _container_name(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)
    return f"la-{safe}"[:120]


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a sandbox here (None: it can): tried once per process with the
    namespaces a rollout gets."""
    bwrap = find_bwrap()
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap, or dnf install bubblewrap)"
    run = Confinement(Sandbox(kind="bwrap"), writable=Path(tempfile.gettempdir()))
    argv = bwrap_argv(run, ["/bin/true"], cwd=Path("/"), bwrap=bwrap)
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not run: {exc}"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        return (
            f"bubblewrap cannot make a sandbox here: {said[-1] if said else f'exit code {done.returncode}'}"
        )
    return None


def container_runtime() -> str | None:
    """The first of podman and docker on PATH (whether it runs is not asked)."""
    return next((name for name in ("podman", "docker") if shutil.which(name)), None)


def resolve_kind(setting: SandboxSetting) -> SandboxKind:
    """``auto``: bwrap where it runs; ``SandboxUnavailable`` with one line otherwise."""
    if setting == "none":
        return "none"
    if setting == "container":
        if container_runtime() is None:
            raise SandboxUnavailable(
                "sandbox 'container' needs podman or docker on PATH (apt-get install podman), "
                'or set sandbox = "bwrap"'
            )
        return "container"
    problem = bwrap_problem()
    if problem is not None:
        what = "sandbox 'auto'" if setting == "auto" else "sandbox 'bwrap'"
        raise SandboxUnavailable(
            f'{what}: {problem}; or set sandbox = "none" to accept running agents unsandboxed'
        )
    return "bwrap"


class SandboxUnavailable(Exception):
    """The sandbox asked for cannot run on this machine (one line: what to install or set)."""
