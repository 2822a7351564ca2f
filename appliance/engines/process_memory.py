"""Host memory of the engine's and the trainer's own processes: :func:`engine_memory`,
:func:`ranks_memory`.

Owns reading, from ``/proc``, the resident memory of the processes the appliance launched for its
engine (a vLLM server and the engine-core workers it spawns share the server's process group)
and for its trainer (the ranks of ``trainer.ranks.RankGroup``, one process each). The torch
engine and the in-process trainers live in the appliance's own process, whose memory
``trainer.device_memory.memory_metrics`` records; an engine attached by URL has no process here.
GPU memory held by those processes is not read (vLLM's own ``/metrics`` reports its KV-cache use).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GIB = 1024**3


def process_group_rss_bytes(pgid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of every process in process group ``pgid`` (0 when none is, or without
    procfs). One read of ``/proc/<pid>/stat`` and ``statm`` per process of the machine."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    try:
        entries = [entry for entry in proc.iterdir() if entry.name.isdigit()]
    except OSError:
        return 0
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
            # Fields after the command (which may hold spaces): state, ppid, pgrp, ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            total += int((entry / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    return total


def process_rss_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of process ``pid`` (0 when it is gone, or without procfs)."""
    try:
        return int((proc / str(pid) / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def engine_pids(engine: Any) -> list[int]:
    """The process-group ids of the servers ``engine`` launched: its own (``server_pid``), or
    each replica's of a fleet (``replicas``)."""
    replicas: Iterable[Any] = getattr(engine, "replicas", None) or (engine,)
    pids = [getattr(replica, "server_pid", None) for replica in replicas]
    return [pid for pid in pids if isinstance(pid, int)]


def engine_memory(engine: Any) -> dict[str, float]:
    """``engine_rss_gib``: resident host memory of the engine's own processes, in GiB, as a
    step records it; empty when the engine has none (the torch engine, an attached server)."""
    pids = engine_pids(engine)
    if not pids:
        return {}
    return {"engine_rss_gib": sum(process_group_rss_bytes(pid) for pid in pids) / GIB}


def ranks_memory(trainer: Any) -> dict[str, float]:
    """``trainer_ranks_rss_gib``: resident host memory of a trainer's rank processes (its
    ``group``'s ``pids()``), in GiB; empty for a trainer without ranks."""
    group = getattr(trainer, "group", None)
    pids = group.pids() if group is not None and hasattr(group, "pids") else []
    if not pids:
        return {}
    return {"trainer_ranks_rss_gib": sum(process_rss_bytes(pid) for pid in pids) / GIB}
