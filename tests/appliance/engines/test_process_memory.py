"""The host memory of an engine's own processes, read from /proc (real child processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.engines.process_memory import (
    GIB,
    engine_memory,
    engine_pids,
    process_group_rss_bytes,
    process_rss_bytes,
    ranks_memory,
)

#: A child that holds ~64 MiB resident and starts a grandchild in its process group.
HOLDER = (
    "import subprocess, sys, time; block = bytearray(64 << 20); "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print('ready', flush=True); time.sleep(60)"
)


@dataclass
class Server:
    server_pid: int | None


@dataclass
class Fleet:
    replicas: tuple[Server, ...]


@pytest.fixture
def group() -> Iterator[int]:
    """A process group of two processes (leader ~64 MiB resident); its id."""
    leader = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "ready"
        yield leader.pid
    finally:
        if leader.pid > 1 and os.getpgid(leader.pid) == leader.pid != os.getpgid(0):
            os.killpg(leader.pid, signal.SIGKILL)  # the leader's own group (a new session)
        leader.wait()


def test_a_process_groups_resident_memory_counts_every_member(group: int) -> None:
    leader_only = int(Path(f"/proc/{group}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    total = process_group_rss_bytes(group)
    assert total >= 64 << 20
    assert total > leader_only  # the grandchild is counted too
    assert process_group_rss_bytes(2**22 + 12345) == 0  # no such group


def test_engine_memory_reads_a_server_a_fleet_and_nothing_for_in_process_engines(group: int) -> None:
    assert engine_pids(Server(group)) == [group]
    assert engine_pids(Fleet((Server(group), Server(None)))) == [group]
    one = engine_memory(Server(group))["engine_rss_gib"]
    assert one >= 64 / 1024
    assert engine_memory(Fleet((Server(group), Server(group))))["engine_rss_gib"] == pytest.approx(
        2 * one, rel=0.2
    )
    assert engine_memory(object()) == {}  # the torch engine: its memory is the appliance's
    assert engine_memory(Server(None)) == {}  # attached by URL
    assert GIB == 1 << 30


@dataclass
class Ranks:
    ids: list[int]

    def pids(self) -> list[int]:
        return self.ids


@dataclass
class RankedTrainer:
    group: Ranks


def test_ranks_memory_sums_each_rank_process(group: int) -> None:
    one = process_rss_bytes(group)
    assert one >= 64 << 20
    assert ranks_memory(RankedTrainer(Ranks([group, group])))["trainer_ranks_rss_gib"] == pytest.approx(
        2 * one / GIB, rel=0.2
    )
    assert ranks_memory(object()) == {}  # an in-process trainer
    assert ranks_memory(RankedTrainer(Ranks([]))) == {}  # ranks stopped
    assert process_rss_bytes(2**22 + 12345) == 0
