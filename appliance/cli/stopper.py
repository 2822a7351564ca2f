"""What the signals do while ``lightning-appliance up`` runs.

Owns the escalation from a bounded stop to an immediate exit, the watchdog that ends a process
whose event loop is stuck after a forced stop, and the lines that say what a stop waits for.
It does not own the stop itself (the appliance's ``request_stop`` and ``force_stop``).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any

from appliance.cli.common import hard_exit
from appliance.config import ApplianceConfig


class Stopper:
    """What the signals do while ``up`` runs: the first SIGINT/SIGTERM asks for a stop (bounded
    by ``stop_timeout_s``, after which the appliance forces it), a second forces it now, a third
    exits at once. A watchdog thread ends the process ``HARD_EXIT_GRACE_S`` after a forced stop
    if the event loop itself is stuck: the store is crash-consistent, so that loses nothing
    acknowledged. In headless mode it says what the stop waits for, every few seconds."""

    HARD_EXIT_GRACE_S = 15.0
    REPORT_EVERY_S = 10.0

    def __init__(self, appliance: Any, config: ApplianceConfig, *, verbose: bool) -> None:
        self.appliance = appliance
        self.timeout_s = config.stop_timeout_s
        self.verbose = verbose
        self.signals = 0
        self._reporter: asyncio.Task[None] | None = None
        self._watchdog: threading.Timer | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            self.appliance.request_stop()
            self._arm_watchdog(self.timeout_s + self.HARD_EXIT_GRACE_S)
            self._say(
                f"stopping ({name}): waiting for {self.appliance.activity()} "
                f"(at most {self.timeout_s:g} s; send it again to stop now)"
            )
            self._reporter = asyncio.ensure_future(self._report())
        elif self.signals == 2:
            self._say(f"stopping now ({name} again): abandoning {self.appliance.activity()}")
            self.appliance.force_stop(f"{name} received twice")
            self._arm_watchdog(self.HARD_EXIT_GRACE_S)
        else:
            self._say(f"exiting at once ({name} a third time)")
            hard_exit(130)

    def _arm_watchdog(self, seconds: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

        def expired() -> None:
            print(
                "lightning-appliance: the stop did not finish in time; exiting "
                "(the event log is consistent: a restart resumes)",
                file=sys.stderr,
                flush=True,
            )
            hard_exit(1)

        self._watchdog = threading.Timer(seconds, expired)
        self._watchdog.daemon = True
        self._watchdog.start()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.REPORT_EVERY_S)
            self._say(f"still stopping: waiting for {self.appliance.activity()}")

    def _say(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self._watchdog is not None and self.appliance.forced is None:
            self._watchdog.cancel()
