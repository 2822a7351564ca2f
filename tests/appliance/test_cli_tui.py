"""``lightning-appliance tui``: which dashboard the flags build, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.cli import main
from tests.tui.run_events import write_run


def test_tui_without_a_store_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tui", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-appliance: no event store at") and "\n" not in err


def test_tui_url_needs_a_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tui", "--url", "http://127.0.0.1:9", "--data-dir", str(tmp_path)]) == 2
    assert "admin token" in capsys.readouterr().err


async def test_tui_db_builds_a_read_only_dashboard(tmp_path: Path) -> None:
    import argparse

    from appliance.cli.tui import tui_app

    db = await write_run(tmp_path / "events.sqlite")
    app = tui_app(argparse.Namespace(db=db, url=None, token=None, data_dir=tmp_path))
    assert not app.source.live and app.control is None
    (tmp_path / "admin_token").write_text("secret\n")
    live = tui_app(argparse.Namespace(db=None, url="http://127.0.0.1:9", token=None, data_dir=tmp_path))
    assert live.source.live and live.control is not None


async def test_status_lists_validation_rounds_apart_from_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from appliance.cli.status import status_report

    await write_run(tmp_path / "events.sqlite")
    report = status_report(tmp_path)
    assert report["validations"], "the fixture run has validation rounds"
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "validation at step" in line]
    assert len(lines) == len(report["validations"])
    first = report["validations"][0]
    assert f"reward {first['reward_mean']:.3f}" in lines[0]
    assert "checksum chain verified" in out
