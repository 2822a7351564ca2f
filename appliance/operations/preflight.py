"""Preflight: what must hold before the appliance loads anything, checked in about a second.

Owns the data directory's lock (one appliance per data directory) and the checks that turn a
start that would fail late (after the model loaded, with a traceback, or worse, a second
appliance writing the same store) into one line a person can act on: the data directory is
writable, the proxy's port is free, the disk has room, the engine is known, the run on disk
was trained with the model asked for, and the placement plan fits the machine (the GPUs' and host
RAM's memory, ``appliance.placement.plan``). Each failure raises :class:`PreflightFailed` (the CLI
prints it as one line and exits 2) before anything is written to the event store.

It does not own the config's validation (``appliance.config``), the plan (``appliance.placement.plan``)
nor the store: it only reads the store, read-only, for the model the run was started with.

Invariant: while an appliance runs on a data directory it holds an exclusive ``flock`` on
``<data_dir>/appliance.lock``, which holds its pid. The kernel drops the lock when the process
exits, however it exits, so a crash never leaves a stale lock; the file itself stays. The
command line takes it (:func:`claim`) before it imports torch or transformers, so a second
appliance on a directory, a port in use or a full disk is refused in about a second; the
``Appliance`` it then builds adopts that lock. While the lock is held the process creates
files with the config's ``data_umask`` (owner-only by default: 0700 directories, 0600 files),
which the processes it starts (vLLM, the trainer's ranks) inherit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.config import ENGINES, ApplianceConfig, recorded_value, umask_bits
from appliance.placement.memory_model import GIB, gib
from contracts.errors import PreflightFailed

if TYPE_CHECKING:
    from appliance.placement.decision import Plan
    from appliance.placement.plan import Machine

__all__ = [
    "LOCK_NAME",
    "OWNER_ONLY",
    "bind_error",
    "check",
    "check_placement",
    "claim",
    "data_dir_lock",
    "recorded_model",
]

log = logging.getLogger(__name__)

#: The lock file in the data directory.
LOCK_NAME = "appliance.lock"
#: The default ``data_umask``: what the appliance creates only its owner may read.
OWNER_ONLY = 0o077

#: Locks taken by :func:`claim`, by resolved data directory: lent to the first
#: :func:`data_dir_lock` of this process on that directory (True while lent).
_claimed: dict[Path, bool] = {}


@contextlib.contextmanager
def claim(config: ApplianceConfig) -> Iterator[Path]:
    """Lock ``config.data_dir`` and run the checks that need neither the model nor torch
    (writable, engine, port, disk, the model the run was started with), for the command line
    to call before it imports the rest; the ``Appliance`` it builds inside adopts the lock.
    Yields the lock file's path."""
    with data_dir_lock(config.data_dir, umask_bits(config.data_umask)) as path:
        key = _key(config.data_dir)
        _claimed[key] = False
        try:
            if config.engine.kind != "auto":
                check_engine(config.engine.kind)
            check_port(config.proxy.host, config.proxy.port)
            check_disk(config.data_dir, config.min_free_disk_gib)
            check_model(config)
            yield path
        finally:
            del _claimed[key]


def _key(data_dir: Path) -> Path:
    return data_dir.expanduser().resolve()


@contextlib.contextmanager
def data_dir_lock(data_dir: Path, umask: int = OWNER_ONLY) -> Iterator[Path]:
    """Create ``data_dir`` if needed, check it is writable and lock it for this process; while
    it is held, the process creates files with ``umask`` (the old one comes back after).

    Raises :class:`PreflightFailed` naming the holder's pid when another appliance (another
    process, or another ``Appliance`` in this one) holds it. A lock this process took with
    :func:`claim` is adopted instead, once. Yields the lock file's path.
    """
    previous = os.umask(umask)
    try:
        with _locked(data_dir) as path:
            yield path
    finally:
        os.umask(previous)


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[Path]:
    key = _key(data_dir) if data_dir.exists() else None
    if key is not None and _claimed.get(key) is False:
        _claimed[key] = True
        try:
            yield data_dir / LOCK_NAME
        finally:
            if key in _claimed:
                _claimed[key] = False
        return
    check_writable(data_dir)
    path = data_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _unwritable(data_dir, exc) from None
    locked = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PreflightFailed(
                f"another appliance ({_holder(fd)}) is running on {data_dir};"
                " stop it or use another --data-dir"
            ) from None
        locked = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        if locked:  # still ours: nobody reads a stale pid from it after we are gone
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # drops the lock


def _holder(fd: int) -> str:
    """``pid N`` of the process holding the lock (as it wrote it), or ``pid unknown``."""
    with contextlib.suppress(OSError, ValueError):
        return f"pid {int(os.pread(fd, 32, 0).decode().strip())}"
    return "pid unknown"  # it has locked but not yet written its pid


def check(config: ApplianceConfig) -> Plan | None:
    """Everything but the lock (which the caller holds): engine, port, disk, model, placement.
    Returns the placement plan (None: a model not known yet, which loading it then reports)."""
    check_engine(config.engine.kind)
    check_port(config.proxy.host, config.proxy.port)
    check_disk(config.data_dir, config.min_free_disk_gib)
    check_model(config)
    return check_placement(config)


def check_placement(config: ApplianceConfig, machine: Machine | None = None) -> Plan | None:
    """The placement plan of ``config`` on ``machine`` (None: this one); refused in one line
    when it does not fit. None: the model is neither registered nor a directory with a
    config.json (``resolve_model`` then says so)."""
    from appliance.placement.machine import plan_for_config

    plan = plan_for_config(config, machine)
    if plan is not None and not plan.fits:
        engine = config.engine
        if engine.kind == "vllm" and engine.vllm_url:  # its memory is taken already: not ours to plan
            log.warning(
                "placement: %s (not enforced: vLLM runs outside, at %s)", plan.reason, engine.vllm_url
            )
        else:
            raise PreflightFailed(f"placement: {plan.reason}")
    return plan


def check_writable(data_dir: Path) -> None:
    """Create ``data_dir`` (and its parents) if needed, then write and delete a probe file."""
    try:
        # 0777 less the umask: with the default, 0700 (a parent made here gets the same).
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".preflight-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with probe.open("xb") as handle:
            handle.write(b"probe\n")
        probe.unlink()
    except OSError as exc:
        raise _unwritable(data_dir, exc) from None


def _unwritable(data_dir: Path, exc: OSError) -> PreflightFailed:
    reason = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(data_dir) else ""
    return PreflightFailed(
        f"data directory {data_dir} is not writable: {reason}{where};"
        " fix its permissions or use another --data-dir"
    )


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise PreflightFailed(f"unknown engine {engine!r}; use one of: {', '.join(ENGINES)}")


def check_port(host: str, port: int) -> None:
    """Bind every address the proxy would bind (as asyncio's ``create_server`` does) and let go.

    Port 0 (any free port) cannot be taken. An address family the machine lacks is skipped,
    as the server skips it.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightFailed(
            f"cannot listen on {host!r}: {exc.strerror}; pass --host with an address of this machine"
        ) from None
    unavailable: OSError | None = None
    bound = 0
    for family, kind, proto, _name, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise bind_error(host, port, exc) from None
                unavailable = exc
                continue
            bound += 1
    if not bound and unavailable is not None:
        raise bind_error(host, port, unavailable)


def bind_error(host: str, port: int, exc: OSError) -> PreflightFailed:
    """The one-line error for a proxy that cannot listen on ``host:port``."""
    retry = "pass --port N (0: any free port)"
    if exc.errno == errno.EADDRINUSE:
        return PreflightFailed(f"port {port} on {host} is already in use by another program; {retry}")
    if exc.errno == errno.EACCES:
        return PreflightFailed(f"no permission to listen on port {port} on {host}; {retry}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return PreflightFailed(f"cannot listen on {host}: not an address of this machine; pass --host")
    reason = " ".join((exc.strerror or str(exc)).split())
    return PreflightFailed(f"cannot listen on {host} port {port}: {reason}; {retry}")


def check_disk(data_dir: Path, min_free_gib: float) -> None:
    if min_free_gib <= 0:
        return
    free = shutil.disk_usage(data_dir).free
    if free < min_free_gib * GIB:
        raise PreflightFailed(
            f"only {gib(free)} free on the disk of {data_dir}, the appliance needs"
            f" {min_free_gib:g} GiB (min_free_disk_gib); free space or use another --data-dir"
        )


def check_model(config: ApplianceConfig) -> None:
    """Refuse to resume a run with another model than it was trained with (its checkpoints
    would not fit: a ``size mismatch`` deep in the trainer)."""
    recorded = recorded_model(config.db_path)
    if recorded is None or _same_model(recorded, config.model):
        return
    raise PreflightFailed(
        f"this run was trained with model {recorded!r}; start it with --model {recorded}"
        " or use another --data-dir"
    )


def recorded_model(db_path: Path) -> str | None:
    """The ``--model`` the last start of the run at ``db_path`` used (None: no run there yet)."""
    from store.events import ApplianceStarted
    from store.eventstore import read_last_sync

    if not db_path.is_file():
        return None
    last = read_last_sync(db_path, {"ApplianceStarted"})
    if last is None or not isinstance(last.event, ApplianceStarted):
        return None
    model = recorded_value(last.event.config, "model")
    return model if isinstance(model, str) and model else last.event.model


def _same_model(recorded: str, wanted: str) -> bool:
    """Registered names must match exactly; local directories by name, so that a run resumes
    with its model directory given by another path (or moved)."""
    from appliance.engines.models import MODELS

    if recorded == wanted:
        return True
    if recorded in MODELS or wanted in MODELS:
        return False
    return Path(recorded).expanduser().resolve().name == Path(wanted).expanduser().resolve().name
