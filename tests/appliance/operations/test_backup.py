"""A run's store on its own: ``events.sqlite`` after a clean stop, and ``lightning-appliance
backup`` of a live run, which an appliance resumes from."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from pathlib import Path

import pytest

from appliance.app import Appliance
from appliance.cli import main
from appliance.cli.status import status_report
from appliance.operations import backup as backup_module
from store.codec import encode
from store.events import ApplianceStarted, PolicyVersionPublished, TrainStepCompleted
from store.eventstore import read_events_sync
from store.projections import RunState
from tests.appliance.appliance_process import ROOT, cli
from tests.support import make_config

BACKED_UP = re.compile(
    r"^backed up (\d+) events \(position (\d+), policy v(\d+), step (\d+)\) and (\d+) files .*"
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data directory of ``lightning-appliance up --steps 1`` with the tiny model, stopped."""
    data_dir = tmp_path_factory.mktemp("finished") / "run"
    done = cli(
        "up", "--headless", "--model", "tiny", "--data-dir", str(data_dir), "--port", "0", "--steps", "1",
        "--group-size", "2", "--batch-groups", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped: reached step 1" in done.stdout
    return data_dir


def test_after_a_clean_stop_events_sqlite_alone_holds_the_run(finished_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(finished_run / "events.sqlite", copy / "events.sqlite")
    events = len(read_events_sync(finished_run / "events.sqlite"))

    done = cli("status", "--data-dir", str(copy))
    assert done.returncode == 0, done.stderr
    assert f"events {events}" in done.stdout
    assert f"checksum chain verified ({events} events)" in done.stdout
    assert "policy v1  step 1" in done.stdout


def modes(root: Path) -> dict[str, str]:
    """Every directory and file under ``root`` (itself included) -> its permission bits, octal."""
    return {str(p.relative_to(root)): f"{p.stat().st_mode & 0o777:04o}" for p in [root, *root.rglob("*")]}


def test_a_run_and_its_backup_are_readable_by_their_owner_alone(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = modes(finished_run)
    assert {"events.sqlite", "admin_token", "appliance.lock", "checkpoints"} <= run.keys()
    assert any(name.startswith("models/") for name in run)  # the model the run built
    assert any(name.endswith(".safetensors") for name in run)  # weights torch wrote
    wrong = {
        name: mode
        for name, mode in run.items()
        if mode != ("0700" if (finished_run / name).is_dir() else "0600")
    }
    assert wrong == {}, "readable by others"

    assert main(["backup", str(tmp_path / "copy"), "--data-dir", str(finished_run)]) == 0
    capsys.readouterr()
    copy = modes(tmp_path / "copy")
    assert len(copy) > 2
    assert {name: mode for name, mode in copy.items() if mode not in ("0700", "0600")} == {}


def test_backup_refuses_a_destination_in_use(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine\n")
    (tmp_path / "file").write_text("mine\n")
    for destination in (tmp_path / "full", tmp_path / "file"):
        assert main(["backup", str(destination), "--data-dir", str(finished_run)]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"lightning-appliance: backup destination {destination} is ")
        assert len(err.splitlines()) == 1
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine\n"
    assert main(["backup", str(tmp_path / "new"), "--data-dir", str(tmp_path / "nothing")]) == 2
    assert "no run at" in capsys.readouterr().err


def test_backup_takes_a_new_snapshot_when_a_needed_file_vanished(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = backup_module._copy
    calls: list[str] = []

    def pruned_once(data_dir: Path, destination: Path, name: str) -> str:
        calls.append(name)
        if len(calls) == 1:  # the appliance pruned it between the snapshot and the copy
            raise FileNotFoundError(name)
        return real_copy(data_dir, destination, name)

    monkeypatch.setattr(backup_module, "_copy", pruned_once)
    report = backup_module.backup(finished_run, tmp_path / "copy")
    assert len(calls) == 1 + len(report.files)
    assert sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*.pt")) == sorted(
        report.files
    )


async def test_backup_of_a_live_run_resumes_at_the_backed_up_version(tmp_path: Path) -> None:
    stepped = asyncio.Event()

    def on_step(step: TrainStepCompleted, state: RunState) -> None:
        if step.step >= 3:
            stepped.set()

    config = make_config(
        tmp_path, Path("tiny"), model="tiny", batch_groups=1, max_steps=1000, checkpoint_every=2
    )
    destination = tmp_path / "backup"
    async with Appliance(config, on_step=on_step) as app:
        run = asyncio.create_task(app.run())
        await asyncio.wait_for(stepped.wait(), 120)
        # The backup runs in another process while this one keeps training.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "appliance.cli", "backup", str(destination),
            "--data-dir", str(config.data_dir),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert not run.done(), "the run went on while it was backed up"
        app.request_stop()
        await asyncio.wait_for(run, 120)
    assert proc.returncode == 0, err.decode()
    (line,) = out.decode().splitlines()
    match = BACKED_UP.match(line)
    assert match, line
    events, position, version, step, files = (int(g) for g in match.groups())
    assert events == position and version >= 3 and step >= 3 and files >= 1

    # The backup is the log up to its position, unchanged, with a verified chain.
    summary = status_report(destination)
    assert summary["events"] == position
    assert summary["chain"] == f"verified ({position} events)"
    assert (summary["policy_version"], summary["step"]) == (version, step)
    source = read_events_sync(config.db_path)
    backed_up = read_events_sync(destination / "events.sqlite")
    assert [(s.position, encode(s.event)) for s in backed_up] == [
        (s.position, encode(s.event)) for s in source[:position]
    ]
    assert (destination / "admin_token").read_text() == (config.data_dir / "admin_token").read_text()
    assert not (destination / "models").exists()
    assert sorted(p.name for p in destination.iterdir()) == ["admin_token", "checkpoints", "events.sqlite"]

    # An appliance on the backup resumes at the backed-up version and trains on from there.
    resumed = make_config(
        tmp_path, Path("tiny"), model="tiny", batch_groups=1, max_steps=step + 1, data_dir=destination
    )
    async with Appliance(resumed) as app:
        assert app.engine.policy_version == version
        assert await app.run() == f"reached step {step + 1}"
    after = [s.event for s in read_events_sync(destination / "events.sqlite")[position:]]
    started = [e for e in after if isinstance(e, ApplianceStarted)]
    assert [(e.resumed_from_version, e.resumed_from_step) for e in started] == [(version, step)]
    assert [e.policy_version for e in after if isinstance(e, PolicyVersionPublished)] == [version + 1]


def test_a_backup_of_a_sharded_run_resumes_with_another_number_of_ranks(tmp_path: Path) -> None:
    """verl's checkpoints are directories of per-rank shards: the backup copies them whole, and
    the copy resumes with one rank what two ranks trained."""
    data_dir, destination = tmp_path / "run", tmp_path / "backup"
    small = ("--headless", "--model", "tiny", "--port", "0", "--group-size", "2", "--batch-groups", "1")
    done = cli(
        "up", *small, "--data-dir", str(data_dir), "--steps", "1", "--trainer", "verl", "--trainer-ranks", "2"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("backup", str(destination), "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    state = RunState.from_events(read_events_sync(destination / "events.sqlite"))
    assert state.checkpoint and (destination / state.checkpoint / "manifest.json").is_file()
    assert state.last_checkpoint is not None
    assert (destination / state.last_checkpoint.path / "manifest.json").is_file()

    done = cli(
        "up",
        *small,
        "--data-dir",
        str(destination),
        "--steps",
        "2",
        "--trainer",
        "verl",
        "--trainer-ranks",
        "1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped: reached step 2" in done.stdout
