"""What a sandbox costs a rollout: its start and stop against none, and a verifier's fresh checkout.

Side by side in one run: the same command (``true``, so the figure is the sandbox's own cost)
run through ``harness_adapters.process.run_process`` unsandboxed, in bubblewrap as a rollout gets
it (its control group, where one can be made here, with memory and process limits; the disk
watchdog; the endpoint socket relayed inside, from a relay on the host side as an adapter used
on its own gets), and in bubblewrap without the control group, each going first in turn,
``--runs`` times each; the median and the 90th percentile of each, the difference of the
medians (the issue's target: bubblewrap adds at most 50 ms a rollout) and what the group costs.
Then a verifier's fresh checkout of a repository of ``--files`` files at a commit from a bare
mirror (``harness_adapters.gitrepos.checkout``: the mirror's objects borrowed, not copied),
median over ``--checkouts``.

    .venv/bin/python scripts/bench_sandbox.py [--runs 200] [--files 2000] [--checkouts 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from harness_adapters.gitrepos import checkout
from harness_adapters.process import run_process
from harness_adapters.relay import EndpointRelay
from harness_adapters.sandbox import Confinement, Endpoint, Sandbox, SandboxLimits, bwrap_problem

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1000,
    }


async def one(root: Path, confinement: Confinement | None) -> float:
    started = time.perf_counter()
    result = await run_process(
        ["true"],
        cwd=root / "work",
        env=ENV | {"HOME": str(root / "home"), "TMPDIR": str(root / "tmp")},
        stdout_path=root / "out",
        stderr_path=root / "err",
        confinement=confinement,
    )
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"the run failed: {result.describe()}: {result.stderr_tail()}")
    return elapsed


async def start_stop(runs: int, scratch: Path) -> dict[str, Any]:
    root = scratch / "rollout"
    for part in ("work", "home", "tmp"):
        (root / part).mkdir(parents=True, exist_ok=True)
    limits = SandboxLimits(memory_mb=8192, processes=1024, disk_mb=20480)
    samples: dict[str, list[float]] = {"none": [], "bwrap": [], "bwrap_no_group": []}
    async with EndpointRelay.open("http://127.0.0.1:8640/rollouts/r/v1") as socket:
        endpoint = Endpoint(socket, "127.0.0.1", 8640)
        runs_by_kind = {
            "none": None,
            # What a rollout gets: its control group (memory and processes), the disk watchdog.
            "bwrap": Confinement(Sandbox(kind="bwrap", limits=limits), writable=root, endpoint=endpoint),
            # The same without a control group (no memory or process limit): what the group costs.
            "bwrap_no_group": Confinement(
                Sandbox(kind="bwrap", limits=SandboxLimits(disk_mb=20480)), writable=root, endpoint=endpoint
            ),
        }
        for _ in range(3):  # warm every path (page cache, the interpreter's imports)
            for confinement in runs_by_kind.values():
                await one(root, confinement)
        for i in range(runs):
            order = list(runs_by_kind.items())
            for kind, confinement in order[i % 3 :] + order[: i % 3]:  # each goes first in turn
                samples[kind].append(await one(root, confinement))
    figures: dict[str, Any] = {"runs": runs} | {kind: quantiles(s) for kind, s in samples.items()}
    figures["added_ms"] = figures["bwrap"]["median_ms"] - figures["none"]["median_ms"]
    figures["group_ms"] = figures["bwrap"]["median_ms"] - figures["bwrap_no_group"]["median_ms"]
    return figures


def make_mirror(scratch: Path, files: int) -> tuple[Path, str]:
    """A bare mirror of a repository of ``files`` small Python files, and its head commit."""
    repo = scratch / "repo"
    for i in range(files):
        path = repo / f"pkg{i % 40}" / f"module_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE_{i} = {i}\n\n\ndef f_{i}(x):\n    return x + {i}\n" * 4)
    env = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", *env, "-C", str(repo), "commit", "-q", "-m", "base"], check=True)
    mirror = scratch / "acme__repo.git"
    subprocess.run(["git", "clone", "-q", "--mirror", str(repo), str(mirror)], check=True)
    head = subprocess.run(
        ["git", "-C", str(mirror), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return mirror, head


def fresh_checkouts(scratch: Path, files: int, count: int) -> dict[str, Any]:
    """A checkout from the mirror against a copy of a working tree (what a task whose ``repo`` is
    a directory gets), taking turns: the disk's speed moves both."""
    mirror, head = make_mirror(scratch, files)
    times: list[float] = []
    copies: list[float] = []
    for i in range(count):
        dest = scratch / f"checkout-{i}"
        started = time.perf_counter()
        checkout(mirror, head, dest)
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        shutil.copytree(
            scratch / "repo", scratch / "copy", symlinks=True, ignore=shutil.ignore_patterns(".git")
        )
        copies.append(time.perf_counter() - started)
        shutil.rmtree(dest)
        shutil.rmtree(scratch / "copy")
    copy_q = quantiles(copies)
    return {"files": files, "checkouts": count, **quantiles(times), "copy_median_ms": copy_q["median_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--checkouts", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    problem = bwrap_problem()
    if problem is not None:
        raise SystemExit(f"bench_sandbox: {problem}")
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as name:
        scratch = Path(name)
        figures = {
            "start_stop": asyncio.run(start_stop(args.runs, scratch)),
            "fresh_checkout": fresh_checkouts(scratch, args.files, args.checkouts),
        }
    if args.json:
        print(json.dumps(figures))
        return
    s, c = figures["start_stop"], figures["fresh_checkout"]
    print(f"rollout start+stop, median of {s['runs']} each, taking turns:")
    for kind in ("none", "bwrap", "bwrap_no_group"):
        print(f"  {kind:<14} {s[kind]['median_ms']:7.1f} ms  (p90 {s[kind]['p90_ms']:.1f} ms)")
    added, group = s["added_ms"], s["group_ms"]
    print(f"  bwrap adds {added:.1f} ms a rollout (target: at most 50 ms); its control group {group:.1f} ms")
    print(
        f"verifier's fresh checkout, {c['files']} files from a bare mirror, median of {c['checkouts']}: "
        f"{c['median_ms']:.1f} ms (p90 {c['p90_ms']:.1f} ms); its files copied: {c['copy_median_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
