"""The run's log file (``appliance.cli.logfile``): the project's DEBUG records in full, the
terminal unchanged, owner-only, never written through a link."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.cli.logfile import NAME, run_log


@pytest.fixture
def terminal() -> Iterator[io.StringIO]:
    """A root logger at WARNING writing to a buffer, as ``entry.main`` sets it up."""
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    saved = (root.level, root.handlers[:])
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    try:
        yield stream
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_the_file_holds_the_projects_debug_records_and_the_terminal_does_not(
    tmp_path: Path, terminal: io.StringIO
) -> None:
    ours, theirs = logging.getLogger("appliance.rollouts.controller"), logging.getLogger("somelib")
    with run_log(tmp_path) as path:
        ours.debug("rollout r1 failed:\nTraceback (most recent call last):\nValueError: boom")
        ours.warning("rollout r1 failed: ValueError: boom")
        theirs.debug("library chatter")
        theirs.warning("library warning")
    text = path.read_text()
    assert path == tmp_path / NAME and path.stat().st_mode & 0o777 == 0o600
    assert "Traceback (most recent call last):\nValueError: boom" in text
    assert "library warning" in text and "library chatter" not in text
    shown = terminal.getvalue()
    assert "rollout r1 failed: ValueError: boom" in shown and "library warning" in shown
    assert "Traceback" not in shown and "library chatter" not in shown
    # Afterwards nothing is left attached: the levels are as they were.
    assert logging.getLogger().handlers[0].level == logging.NOTSET
    assert ours.getEffectiveLevel() == logging.WARNING
    ours.warning("after the run")
    assert "after the run" not in path.read_text()


def test_a_restart_appends_and_a_link_in_its_place_is_refused(tmp_path: Path, terminal: io.StringIO) -> None:
    log = logging.getLogger("appliance.app")
    for n in (1, 2):
        with run_log(tmp_path):
            log.warning("run %d", n)
    assert [line.split(": ", 1)[1] for line in (tmp_path / NAME).read_text().splitlines()] == [
        "run 1",
        "run 2",
    ]

    elsewhere = tmp_path / "other"
    (elsewhere / NAME).parent.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (elsewhere / NAME).symlink_to(victim)
    with pytest.raises(OSError), run_log(elsewhere):
        pass
    assert victim.read_text() == "keep\n"
