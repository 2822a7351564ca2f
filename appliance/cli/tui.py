"""``lightning-appliance tui``: the dashboard on a running appliance or on a run's store.

Owns the choice of its source: a running appliance's proxy (``--url``, with the admin token
from ``--token``, ``APPLIANCE_ADMIN_TOKEN`` or the run directory) or a run's
``events.sqlite`` opened read-only (``--db``, controls off). The dashboard itself is ``tui``'s.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contracts.errors import ApplianceError

if TYPE_CHECKING:
    from tui.app import DashboardApp


def add_parser(sub: Any) -> None:
    """``tui`` and its flags."""
    tui = sub.add_parser("tui", help="the dashboard: on a running appliance, or a run's store read-only")
    where = tui.add_mutually_exclusive_group()
    where.add_argument("--db", type=Path, help="a run's events.sqlite, opened read-only (controls off)")
    where.add_argument("--url", help="a running appliance's proxy URL, e.g. http://127.0.0.1:8640")
    tui.add_argument("--token", help="admin token for --url (default: <data-dir>/admin_token)")
    tui.add_argument(
        "--data-dir",
        type=Path,
        default=Path("appliance-data"),
        help="run directory (default ./appliance-data)",
    )


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance tui``: the dashboard until it is quit."""
    tui_app(args).run()
    return 0


def tui_app(args: argparse.Namespace) -> DashboardApp:
    """The dashboard ``lightning-appliance tui`` shows, built from its flags."""
    from tui.app import DashboardApp
    from tui.source import ControlClient, HttpSource, SqliteSource

    data_dir: Path = args.data_dir
    if args.url:
        token = args.token or os.environ.get("APPLIANCE_ADMIN_TOKEN")
        token_file = data_dir / "admin_token"
        if not token and token_file.is_file():
            token = token_file.read_text().strip()
        if not token:
            raise ApplianceError(
                f"--url needs the admin token: pass --token or run where {token_file} exists"
            )
        return DashboardApp(
            HttpSource(args.url, token),
            control=ControlClient(args.url, token),
            data_dir=data_dir,
            freeze_gc=True,
        )
    db: Path = args.db or data_dir / "events.sqlite"
    if not db.is_file():
        raise ApplianceError(f"no event store at {db}; pass --db FILE or --url URL")
    return DashboardApp(SqliteSource(db, live=False), data_dir=db.parent, freeze_gc=True)
