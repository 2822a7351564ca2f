"""A rollout's control group, for real where this process may make one (root on cgroup v1, or a
delegated v2 subtree): its limits written, a breach read back by name, nothing left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness_adapters import cgroups

FOUND = cgroups.find()
pytestmark = pytest.mark.skipif(FOUND is None, reason="no control group can be made here")


def test_a_group_holds_its_limits_and_is_removed() -> None:
    assert FOUND is not None
    limits = cgroups.GroupLimits(memory_bytes=64 << 20, processes=8, cpus=0.5)
    group = FOUND.create("t-limits", limits)
    try:
        if group.version == 1:
            assert int((group.by_controller["memory"] / "memory.limit_in_bytes").read_text()) == 64 << 20
            assert (group.by_controller["pids"] / "pids.max").read_text().strip() == "8"
            assert (group.by_controller["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        else:
            assert (group.dirs[0] / "memory.max").read_text().strip() == str(64 << 20)
            assert (group.dirs[0] / "pids.max").read_text().strip() == "8"
        assert group.breach() is None
        # A process in the group that forks past pids.max: the kernel refuses, the breach is named.
        forks = (
            "import os\nfor _ in range(20):\n    try:\n        os.fork() or os._exit(0)\n"
            "    except OSError:\n        pass\n"
        )
        joined = "; ".join(f"echo $$ > {f}" for f in group.procs_files())
        subprocess.run(["sh", "-c", f"{joined}; exec {sys.executable} -c '{forks}'"], check=False, timeout=60)
        assert group.breach() == "process limit reached (8 processes)"
    finally:
        group.close()
    assert not any(d.exists() for d in group.dirs)


def test_only_the_hierarchies_a_limit_needs() -> None:
    assert FOUND is not None
    group = FOUND.create("t-pids", cgroups.GroupLimits(processes=100))
    try:
        if group.version == 1:
            assert set(group.by_controller) == {"pids"}
    finally:
        group.close()


def test_groups_left_by_a_process_that_is_gone_are_removed() -> None:
    assert FOUND is not None
    parent = next(iter(FOUND.parents.values())).parent
    stale = parent / "lightning-appliance-999999999"
    (stale / "g000001-r0").mkdir(parents=True)
    cgroups._remove_stale(FOUND)
    assert not stale.exists()
