"""``lightning-appliance status``: the trainer ranks of the last start and the disk the run uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.cli.status import disk_usage, human_bytes, status_report
from appliance.config import load_config
from store.codec import decode, encode
from store.events import ApplianceStarted
from store.eventstore import EventStore
from tests.tui.run_events import run_events, write_run


def _start(trainer_ranks: int, config: dict[str, object] | None = None) -> ApplianceStarted:
    return ApplianceStarted(
        ts=1_780_000_100.0,
        run_id="run-fixture-0001",
        model="tiny",
        engine="torch",
        resumed_from_version=1,
        resumed_from_step=1,
        config=config or {},
        trainer_ranks=trainer_ranks,
    )


def _write(path: Path, size: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return size


async def test_status_reports_trainer_ranks_and_disk_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    await write_run(run / "events.sqlite", [*run_events(), _start(2), _start(4)])
    # Checkpoints as directories of shard files, nested; an export; a cached model; other files.
    shards = sum(_write(run / "checkpoints" / "v2" / f"model-{r}-of-2.safetensors", 3000) for r in range(2))
    shards += _write(run / "checkpoints" / "v2" / "optim" / "rank0.pt", 500)
    shards += _write(run / "checkpoints" / "weights-v3.safetensors", 700)
    # Per-version fp32 weights and the bf16 copies of published versions, each its own kind.
    weights = _write(run / "checkpoints" / "weights" / "v000003.pt", 900)
    published = sum(_write(run / "checkpoints" / "published" / f"v00000{v}.safetensors", 450) for v in (2, 3))
    export = _write(run / "export" / "model.safetensors", 2048)
    models = _write(run / "models" / "tiny" / "config.json", 10)
    other = _write(run / "admin_token", 33) + _write(run / "logs" / "vllm.log", 100)

    assert main(["status", "--data-dir", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trainer_ranks"] == 4  # the last start's
    disk = report["disk_bytes"]
    log = sum(p.stat().st_size for p in run.glob("events.sqlite*"))
    assert disk == {
        "log": log,
        "checkpoints": shards,
        "weights": weights,
        "published": published,
        "export": export,
        "models": models,
        "other": other,
        "total": log + shards + weights + published + export + models + other,
    }

    assert main(["status", "--data-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "starts 3  trainer ranks 4" in out
    disk_line = next(line for line in out.splitlines() if line.startswith("disk "))
    assert disk_line.startswith(f"disk {human_bytes(disk['total'])} (log ")
    assert "checkpoints 7.0 KiB" in disk_line and "export 2.0 KiB" in disk_line
    assert "weights 900 B" in disk_line and "published 900 B" in disk_line


@pytest.mark.parametrize("shape", ["flat", "nested"])
async def test_status_of_a_run_without_ranks_and_an_export_elsewhere(tmp_path: Path, shape: str) -> None:
    elsewhere = tmp_path / "exported"
    size = _write(elsewhere / "model.safetensors", 4096)
    run = tmp_path / "run"
    run.mkdir()
    # The recorded config: flat (every field at the top level, as runs of earlier versions
    # recorded it) or by section, as ``ApplianceConfig.to_json`` records it now.
    config: dict[str, object] = {"model": "tiny", "engine": "torch", "export_dir": str(elsewhere)}
    if shape == "nested":
        config = load_config(overrides={"export_dir": elsewhere, "model": "tiny"}, env={}).to_json()
        assert config["trainer"]["export_dir"] == str(elsewhere) and "export_dir" not in config  # type: ignore[index]
    await write_run(run / "events.sqlite", [*run_events(), _start(1, config)])
    report = status_report(run)
    assert report["trainer_ranks"] == 1
    assert report["disk_bytes"]["export"] == size and report["disk_bytes"]["checkpoints"] == 0

    (tmp_path / "empty").mkdir()
    async with await EventStore.open(tmp_path / "empty" / "events.sqlite"):
        pass
    assert status_report(tmp_path / "empty")["trainer_ranks"] == 1  # no start recorded


def test_an_appliance_started_written_before_trainer_ranks_decodes_with_one() -> None:
    row = encode(_start(3))
    data = json.loads(row.data)
    assert data.pop("trainer_ranks") == 3
    old = decode(row.type, row.version, row.ts, json.dumps(data), row.blob)
    assert isinstance(old, ApplianceStarted) and old.trainer_ranks == 1


def test_disk_usage_counts_nothing_for_a_missing_directory(tmp_path: Path) -> None:
    assert disk_usage(tmp_path / "nowhere") == dict.fromkeys(
        ("log", "checkpoints", "weights", "published", "export", "models", "other", "total"), 0
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3_565_158, "3.4 MiB"), (1_288_490_189, "1.2 GiB")],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(("value", "said"), [("-1", "must be 0 or more, not -1"), ("x", "whole number")])
def test_a_negative_failure_count_is_refused(
    value: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["status", "--data-dir", str(tmp_path), "--failures", value])
    assert refused.value.code == 2
    assert said in capsys.readouterr().err
