"""The circuit breaker end to end: a harness that always exits 1 pauses admissions, with back-off.

A real appliance (tiny model, real store, proxy and scheduler) runs the ``command`` adapter with
an agent that writes to stderr and exits 1. After ``breaker_failures`` failures in a row the
scheduler records ``AdmissionsPaused`` naming the exit code and the stderr tail, admits nothing
during the back-off, reports it on ``/healthz`` and as a notice, resumes, and doubles the
back-off on the next trip. The headless command line prints the notice as one line. After
``breaker_max_trips`` trips in a row the run stops naming the last failure, ``up`` exits 1, and a
later start on the same directory resumes (its trips counted afresh).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.cli.up import EXIT_RUN_FAILED, _up
from store.events import AdmissionsPaused, ApplianceStarted, ApplianceStopped, RolloutCreated
from store.eventstore import EventStore, read_events_sync
from tests.appliance.appliance_process import up
from tests.support import make_config

#: What the failing agent writes to stderr before it exits 1.
STDERR = "fatal: no OPENAI_API_KEY that works"
AGENT = ["sh", "-c", f"echo 'starting'; echo '{STDERR}' >&2; exit 1"]


async def healthz(app: Appliance) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{app.proxy_url}/healthz") as response:
        return response.status, await response.json()


async def test_failing_harness_pauses_admissions_with_back_off(tmp_path: Path, tiny_model_dir: Path) -> None:
    notices: list[str] = []
    paused, resumed = asyncio.Event(), asyncio.Event()

    def on_notice(line: str) -> None:
        notices.append(line)
        if line.startswith("admissions paused"):
            paused.set()
        elif line == "admissions resumed":
            resumed.set()

    config = make_config(
        tmp_path,
        tiny_model_dir,
        adapter={"adapter": "command", "command": AGENT},
        breaker_failures=4,  # one sync batch: two groups of two
        breaker_backoff_s=2.0,
        breaker_backoff_max_s=30.0,
    )
    async with Appliance(config, on_notice=on_notice) as app:
        run = asyncio.create_task(app.run())
        try:
            async with asyncio.timeout(120):
                # First trip: /healthz names the cause while the back-off runs.
                await paused.wait()
                status, body = await healthz(app)
                assert status == 503, body
                (reason,) = body["reasons"]
                assert "4 training rollouts failed in a row" in reason
                assert "exit code 1" in reason and STDERR in reason
                # The back-off ends: healthy again, admissions resume.
                await resumed.wait()
                status, body = await healthz(app)
                assert status == 200 and body["status"] == "ok", body
                paused.clear()
                # The next batch fails too: a second trip, with the back-off doubled.
                await paused.wait()
            app.request_stop()
            assert await asyncio.wait_for(run, 60) == "stop requested"
        finally:
            run.cancel()
        events = [s.event for s in await app.store.read()]

    trips = [e for e in events if isinstance(e, AdmissionsPaused)]
    assert [(t.trips, t.backoff_s) for t in trips] == [(1, 2.0), (2, 4.0)]
    first, second = trips
    assert first.failures == 4  # a group may end between two decisions: the second may see more
    assert second.failures >= 4
    for trip in trips:
        assert trip.cause.startswith("AgentFailed: agent exit code 1")
        assert STDERR in trip.cause
    # Dead groups are replaced until the trip (the replacements may still run during the
    # back-off), nothing is admitted during a back-off, and admissions resume after it.
    created = [e.ts for e in events if isinstance(e, RolloutCreated)]
    assert len([ts for ts in created if ts < first.ts]) >= 4
    for trip in trips:
        assert not [ts for ts in created if trip.ts <= ts < trip.ts + trip.backoff_s]
    assert [ts for ts in created if first.ts + first.backoff_s <= ts < second.ts]
    assert notices[0] == (
        "admissions paused for 2 s: 4 training rollouts failed in a row; last: "
        f"AgentFailed: agent exit code 1: {STDERR}"
    )
    assert notices[1] == "admissions resumed"
    assert notices[2].startswith(f"admissions paused for 4 s: {second.failures} training rollouts")
    assert notices[2].endswith("(trip 2 in a row)")


def test_headless_up_prints_the_pause(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "appliance.toml"
    config.write_text(
        "breaker_failures = 2\nbreaker_backoff_s = 30.0\nvalidate_every = 0\nmax_tokens = 8\n"
        f'[adapter]\nadapter = "command"\ncommand = {json.dumps(AGENT)}\n'
    )
    proc = up(tmp_path / "run", tiny_model_dir, 5, "--config", str(config))
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("admissions paused") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines += rest.splitlines()
    assert proc.returncode == 0, "\n".join(lines)
    (pause,) = [line for line in lines if line.startswith("admissions paused")]
    assert pause == (
        "admissions paused for 30 s: 2 training rollouts failed in a row; last: "
        f"AgentFailed: agent exit code 1: {STDERR}"
    )
    assert lines[-1] == "stopped: stop requested"


def gave_up(trips: int) -> str:
    return (
        f"the circuit breaker tripped {trips} time{'s' if trips > 1 else ''} in a row (breaker_max_trips) "
        f"with no training rollout finished; last failure: AgentFailed: agent exit code 1: {STDERR}"
    )


async def test_the_breaker_gives_up_after_max_trips_and_a_restart_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(
        tmp_path,
        tiny_model_dir,
        adapter={"adapter": "command", "command": AGENT},
        breaker_failures=2,
        breaker_backoff_s=0.2,
        breaker_backoff_max_s=1.0,
        breaker_max_trips=2,
    )
    notices: list[str] = []
    async with Appliance(config, on_notice=notices.append) as app:
        assert await asyncio.wait_for(app.run(), 120) == gave_up(2)
        assert app.failed
    # A restart is a fresh try: it admits again, and gives up after as many trips again.
    async with Appliance(config) as again:
        assert again.live.state.breaker_trips == 0
        assert await asyncio.wait_for(again.run(), 120) == gave_up(2)
        assert again.failed
    store = await EventStore.open(config.db_path)
    try:
        events = [s.event for s in await store.read()]
    finally:
        await store.close()

    starts = [i for i, e in enumerate(events) if isinstance(e, ApplianceStarted)]
    assert len(starts) == 2
    for run in (events[starts[0] : starts[1]], events[starts[1] :]):
        # The final trip is the stop, recorded as one with the breaker's reason: no pause first.
        assert [e.trips for e in run if isinstance(e, AdmissionsPaused)] == [1]
        assert any(isinstance(e, RolloutCreated) for e in run)
        (stopped,) = [e for e in run if isinstance(e, ApplianceStopped)]
        assert (stopped.reason, stopped.failed, stopped.command) == (gave_up(2), True, "up")
    # The back-off of the first trip is shown; the last trip stops the run instead. Rollouts run
    # concurrently, so a third may fail before the scheduler observes the second: the count in
    # the notice is what was observed, at least the threshold.
    (paused,) = [line for line in notices if line.startswith("admissions paused")]
    shown = re.fullmatch(
        r"admissions paused for 0\.2 s: (\d+) training rollouts failed in a row; last: (.*)", paused
    )
    assert shown is not None, paused
    assert int(shown.group(1)) >= 2
    assert shown.group(2) == f"AgentFailed: agent exit code 1: {STDERR}"


async def test_up_returns_non_zero_naming_the_last_failure(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``up``'s own coroutine, in this process: the exit status and its last line."""
    config = make_config(
        tmp_path,
        tiny_model_dir,
        adapter={"adapter": "command", "command": AGENT},
        breaker_failures=2,
        breaker_backoff_s=0.2,
        breaker_max_trips=1,
    )
    assert await asyncio.wait_for(_up(config, headless=True), 120) == EXIT_RUN_FAILED == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"stopped: {gave_up(1)}"
    assert not [line for line in lines if line.startswith("admissions paused")]


@pytest.mark.slow
def test_up_exits_non_zero_naming_the_last_failure_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "appliance.toml"
    config.write_text(
        "breaker_failures = 2\nbreaker_backoff_s = 0.2\nbreaker_max_trips = 2\nvalidate_every = 0\n"
        f'max_tokens = 8\n[adapter]\nadapter = "command"\ncommand = {json.dumps(AGENT)}\n'
    )
    for _ in range(2):  # the second `up` on the same directory resumes, and gives up again
        proc = up(tmp_path / "run", tiny_model_dir, 1, "--config", str(config))
        try:
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = out.splitlines()
        assert proc.returncode == 1, out
        assert lines[-1] == f"stopped: {gave_up(2)}"
        assert [line for line in lines if line.startswith("admissions paused")] == [
            "admissions paused for 0.2 s: 2 training rollouts failed in a row; last: "
            f"AgentFailed: agent exit code 1: {STDERR}"
        ]


#: An agent whose failure is a multi-line traceback on stderr.
TRACEBACK_AGENT = [
    "sh",
    "-c",
    "echo 'Traceback (most recent call last):' >&2; echo '  File \"agent.py\", line 1' >&2; "
    "echo 'ValueError: boom' >&2; exit 1",
]
CRASH = (
    'AgentFailed: agent exit code 1: Traceback (most recent call last): | File "agent.py", line 1 | '
    "ValueError: boom"
)


def test_a_run_the_breaker_stopped_says_so_and_eval_plays_its_agent(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Headless ``up`` with an agent that always fails: one line per failed rollout and the
    breaker's lines once; ``status`` names the stop and its reason; ``eval`` on the directory
    plays the run's agent, says that no rollout finished (exit 1), and leaves the run's stop."""
    from tests.appliance.appliance_process import cli
    from tui.model import DashboardModel

    config = tmp_path / "appliance.toml"
    config.write_text(
        "breaker_failures = 2\nbreaker_backoff_s = 0.2\nbreaker_max_trips = 2\nvalidate_every = 0\n"
        f'max_tokens = 8\n[adapter]\nadapter = "command"\ncommand = {json.dumps(TRACEBACK_AGENT)}\n'
    )
    data = tmp_path / "run"
    proc = up(data, tiny_model_dir, 1, "--config", str(config))
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    lines = out.splitlines()
    failed = [line for line in lines if " failed: " in line and "rollout " in line]
    assert failed and all(line.endswith(f"failed: {CRASH}") for line in failed), out
    assert not [line for line in lines if line.startswith(("Traceback", "  File", "ValueError"))], out
    # The whole traceback is in the run's log file (owner-only), not on the terminal.
    log = data / "appliance.log"
    assert log.stat().st_mode & 0o777 == 0o600
    assert '\n  File "agent.py", line 1\nValueError: boom' in log.read_text(), log.read_text()[-3000:]
    stop = (
        "the circuit breaker tripped 2 times in a row (breaker_max_trips) with no training rollout "
        f"finished; last failure: {CRASH}"
    )
    assert [line for line in lines if "admissions paused" in line] == [
        f"admissions paused for 0.2 s: 2 training rollouts failed in a row; last: {CRASH}"
    ], out
    assert [line for line in lines if "circuit breaker tripped" in line] == [f"stopped: {stop}"], out

    def status() -> tuple[list[str], dict[str, Any]]:
        text = cli("status", "--data-dir", str(data), timeout=120)
        report = cli("status", "--data-dir", str(data), "--json", timeout=120)
        assert text.returncode == report.returncode == 0, text.stderr + report.stderr
        return text.stdout.splitlines(), json.loads(report.stdout)

    lines, report = status()
    assert f"stopped (the run could not go on): {stop}" in lines
    assert (report["stopped"]["reason"], report["stopped"]["failed"]) == (stop, True)

    # eval with no harness flags plays the run's agent, which fails every rollout.
    done = cli("eval", "--data-dir", str(data), "--model", str(tiny_model_dir), "--port", "0", timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    agent = "command: " + shlex.join(TRACEBACK_AGENT)
    assert f"agent {agent}, " in done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert f"  agent {agent}  " in line, line
    count = int(line.split(" = ")[1].split()[0])
    assert line.endswith(f"  no rollout finished: {count} failed: {CRASH} x{count}"), line
    assert "reward" not in line

    # The run's stop survives the evaluation's, in status and on the dashboard.
    lines, report = status()
    assert f"stopped (the run could not go on): {stop}" in lines
    assert report["stopped"]["reason"] == stop
    (evaluation,) = report["evaluations"]
    assert evaluation["agent"] == agent
    assert next(line for line in lines if line.startswith("  eval ")).endswith(
        f"no rollout finished: {count} failed: {CRASH} x{count}  agent {agent}"
    )
    model = DashboardModel()
    model.extend(read_events_sync(data / "events.sqlite"))
    assert model.stop_text() == f"stopped: {stop}"
