"""``lightning-appliance backup``: a consistent copy of a run, also of a running one.

Owns the command's flags and its one line; the copy is ``appliance.operations.backup``'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from appliance.config import load_config, umask_bits


def add_parser(sub: Any) -> None:
    """``backup`` and its flags."""
    backup = sub.add_parser("backup", help="copy a run consistently, also while it runs")
    backup.add_argument("destination", type=Path, help="a new (or empty) directory for the copy")
    backup.add_argument("--data-dir", type=Path, default=Path("appliance-data"))


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance backup``: 0 with the copy made."""
    from appliance.operations.backup import backup

    umask = umask_bits(load_config(resolved=False).data_umask)  # APPLIANCE_DATA_UMASK
    print(backup(args.data_dir, args.destination, umask).line())
    return 0
