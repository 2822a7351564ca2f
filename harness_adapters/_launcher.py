"""The launcher every agent process runs under: resource limits, and nothing left behind.

Run as ``python -I -S _launcher.py '<spec json>' <argv...>`` by ``harness_adapters.process``, as
the leader of a new session. It owns the agent's process tree:

* it makes itself a child subreaper (Linux), so every process the agent starts stays its
  descendant even after a double fork or ``setsid`` (which would escape a process-group kill);
* it applies the resource limits to the agent only (``setrlimit`` in ``preexec_fn`` is safe
  here: the launcher has a single thread, unlike the appliance);
* when the agent exits, or ``grace_s`` after a SIGTERM, it SIGKILLs every remaining
  descendant (stopped first, so none can fork away) and reaps them, then exits with the
  agent's code (``128 + N`` if a signal ``N`` ended it, ``127`` if it could not be started).

In a sandbox (``harness_adapters.sandbox``) it runs inside, as the first process of the
sandbox's PID namespace but bwrap's own (``namespace``: when it exits the kernel ends every
process left in it, so it neither reaps nor needs to be a subreaper). There it listens on the
loopback address and port of the rollout's URL (``forward``) and relays each connection to the
rollout's Unix socket, before it starts the agent. The listening socket is made before the
agent starts (a first call cannot come too early) and served by threads started after it
(``preexec_fn`` stays safe).

It imports only the standard library and never the appliance, so it starts in ~20 ms. The
``/proc`` helpers are also used by the parent side to kill a launcher that does not answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
import time
from typing import TYPE_CHECKING

# Imported where used (socket and threading for the endpoint only, ctypes outside a namespace
# only): every rollout starts this, and each import is milliseconds.
if TYPE_CHECKING:
    import socket
    from types import FrameType

PR_SET_CHILD_SUBREAPER = 36


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process visible in ``/proc`` (empty without /proc)."""
    kids: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")  # noqa: PTH208 (stdlib only, fast)
    except OSError:
        return kids
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:  # noqa: PTH123 (stdlib only, fast)
                stat = handle.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        # the last ")".
        fields = stat[stat.rindex(b")") + 2 :].split()
        kids.setdefault(int(fields[1]), []).append(int(name))
    return kids


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree, parents before children."""
    kids = children_map()
    found: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child in kids.get(pid, ()):
            found.append(child)
            frontier.append(child)
    return found


def kill_tree(root: int, *, include_root: bool) -> int:
    """SIGKILL every descendant of ``root`` (and ``root`` itself if asked); returns how many.

    The tree is stopped first and walked again, so a process forking during the walk cannot
    leave a child behind that the first walk missed.
    """
    seen: set[int] = set()
    for _ in range(3):
        found = [pid for pid in descendants(root) if pid not in seen]
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        seen.update(found)
    targets = [*seen, root] if include_root else list(seen)
    for pid in targets:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(seen)


def _become_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_all() -> None:
    """Kill and reap every descendant until none is left (orphans come to us as subreaper)."""
    me = os.getpid()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        kill_tree(me, include_root=False)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.01)


def _listen(host: str, port: int) -> socket.socket:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    return listener


def _pump(source: socket.socket, sink: socket.socket) -> None:
    import socket

    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _relay(client: socket.socket, path: str) -> None:
    """One connection: the client's bytes to the Unix socket and back, until both sides end."""
    import socket
    import threading

    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, path: str) -> None:
    import socket
    import threading

    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(client, path), daemon=True).start()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    command = argv[2:]
    limits: dict[str, list[int]] = spec.get("limits", {})
    grace_s = float(spec.get("grace_s", 5.0))
    # In a PID namespace of its own the namespace ends with the launcher, and every process in
    # it: nothing to reap, no subreaper needed.
    in_namespace = bool(spec.get("namespace"))
    if not in_namespace:
        _become_subreaper()
    forward = spec.get("forward")
    listener = None
    if forward is not None:
        try:
            listener = _listen(forward["host"], int(forward["port"]))
        except OSError as exc:
            sys.stderr.write(f"launcher: cannot listen on the rollout's endpoint: {exc}\n")
            return 127

    import subprocess

    def apply_limits() -> None:
        for name, (soft, hard) in limits.items():
            resource.setrlimit(getattr(resource, name), (soft, hard))

    try:
        child = subprocess.Popen(command, preexec_fn=apply_limits if limits else None)
    except (OSError, subprocess.SubprocessError) as exc:
        sys.stderr.write(f"launcher: cannot start {command[0]!r}: {exc}\n")
        return 127
    if listener is not None and forward is not None:
        import threading

        threading.Thread(target=_serve, args=(listener, forward["unix"]), daemon=True).start()

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        kill_tree(os.getpid(), include_root=False)

    def on_term(signum: int, frame: FrameType | None) -> None:
        # The parent signalled our whole process group; processes that left it (setsid) are
        # told too. Whatever still runs after the grace period is killed.
        own_group = os.getpgid(0)
        for pid in descendants(os.getpid()):
            with contextlib.suppress(OSError):
                if os.getpgid(pid) != own_group:
                    os.kill(pid, signal.SIGTERM)
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, grace_s)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_term)
    code = child.wait()
    signal.setitimer(signal.ITIMER_REAL, 0)
    if not in_namespace:
        _reap_all()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
