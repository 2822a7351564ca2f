"""The run's log file: ``<data_dir>/appliance.log``, what ``up`` logs in full.

The terminal gets one line per notable thing (a failed rollout is one WARNING line, its reason
shortened); the file gets the project's own records at DEBUG as well, so a failed rollout's whole
traceback, the sandbox's lines and the scheduler's decisions are there to read after the run.
Other libraries' records reach it at the terminal's level only (their DEBUG records are noise).
The file is owner-only, appended to across restarts, and rotated at :data:`MAX_BYTES` with
:data:`BACKUPS` older files kept. This module owns that file's handler, nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
from collections.abc import Iterator
from pathlib import Path

#: The file's name in the data directory.
NAME = "appliance.log"
#: Rotate past this size ...
MAX_BYTES = 20 * 1024 * 1024
#: ... keeping this many older files (``appliance.log.1`` ...).
BACKUPS = 3
#: The packages whose DEBUG records the file holds.
PACKAGES = ("appliance", "harness_adapters", "store", "trainer", "tui", "contracts")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def run_log(data_dir: Path) -> Iterator[Path]:
    """Log to ``data_dir``'s log file while the block runs; the terminal's handlers keep their
    level (the root logger's, set by the command's ``-v``) and see nothing new."""
    path = data_dir / NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.close(fd)  # created owner-only and never through a link; the handler reopens it by name
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8"
    )
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    terminal_level = root.level
    terminals = list(root.handlers)
    before = [existing.level for existing in terminals]
    for existing in terminals:  # the terminal keeps what it showed before
        existing.setLevel(max(existing.level, terminal_level))
    loggers = [logging.getLogger(name) for name in PACKAGES]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
    root.addHandler(handler)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for existing, level in zip(terminals, before, strict=True):
            existing.setLevel(level)
