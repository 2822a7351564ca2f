"""The ``lightning-appliance`` command line.

``up`` runs the appliance until it is stopped or reaches ``--steps`` (the run's total: a restarted
run continues to the same target), showing the dashboard (``tui``) when stdout is a terminal and
progress lines otherwise or with ``--headless``; ``status`` reads the store and prints the run
summarised (with the disk it takes), also while another process is writing it; ``tui`` opens the
dashboard on a running appliance (``--url``) or on a run's store, read-only (``--db``); ``eval``
plays a split's tasks on the run's current policy, with no training; ``backup`` copies a run, also
a running one (``appliance.operations.backup``); ``export`` writes its recorded rollouts as a
dataset file (``appliance.reporting.export``); ``plan`` prints the GPU placement of a model on
this machine or a described one (``appliance.placement.plan``), exit status 2 when it does not
fit; ``doctor`` tells what this machine offers a run and what to fix
(``appliance.operations.doctor``).
Errors a person can fix are printed as one line and exit with status 2.

This module owns the parser (each subcommand's module adds its own flags, ``add_parser``,
and runs it, ``run``), the logging setup, and what a command's end makes of the exit status:
an error a person can fix is one line on stderr and status 2, a forced stop 0, Ctrl-C 130,
a closed stdout 141 with no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, Protocol

from appliance.cli import backup, doctor, engine_host, evaluate, export, plan, status, tasks, tui, up
from appliance.cli.common import hard_exit
from contracts.errors import ApplianceError, StopForced


class Command(Protocol):
    """A subcommand's module."""

    def add_parser(self, sub: Any) -> None:
        """Add the subcommand and its flags to the subparsers ``sub``."""

    def run(self, args: argparse.Namespace) -> int:
        """Run the subcommand; its exit status."""


#: Each subcommand's module by its name, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {
    "up": up,
    "eval": evaluate,
    "status": status,
    "backup": backup,
    "export": export,
    "tui": tui,
    "doctor": doctor,
    "plan": plan,
    "tasks": tasks,
    "engine-host": engine_host,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-appliance", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


#: The exit status of a command whose reader went away (``status | head``): a shell's for a
#: process that SIGPIPE ended, 128 + 13.
EXIT_CLOSED_STDOUT = 128 + signal.SIGPIPE
_P = ParamSpec("_P")


def _quiet_on_closed_stdout(command: Callable[_P, int]) -> Callable[_P, int]:
    """``command`` ending quietly with :data:`EXIT_CLOSED_STDOUT` when its stdout is a pipe
    that was closed (``lightning-appliance status | head -1``), rather than with a
    ``BrokenPipeError`` traceback. Python ignores SIGPIPE, so a write to a closed pipe raises;
    what is still buffered is flushed here, inside the handler, and stdout then points at
    /dev/null so that the interpreter's own flush at exit cannot fail again."""

    @functools.wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> int:
        try:
            code = command(*args, **kwargs)
            sys.stdout.flush()
        except BrokenPipeError:
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            return EXIT_CLOSED_STDOUT
        return code

    return run


@_quiet_on_closed_stdout
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Model loading progress bars would drown the progress lines.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command].run(args)
    except StopForced as exc:
        print(f"stopped: {exc.message}", flush=True)
        hard_exit(0)  # the model may still be loading in a worker thread
        return 0
    except ApplianceError as exc:
        print(f"lightning-appliance: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
