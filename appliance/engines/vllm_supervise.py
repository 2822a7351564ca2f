"""The vLLM engine's supervision: a server that dies is restarted and given its weights again.

Owns the supervisor task: it waits for the launched server to exit, then relaunches it (a fresh
port; ``MAX_RESTART_FAILURES`` attempts, each waiting longer) while the engine holds its GPU
memory, since a collocated trainer holds it while the engine sleeps: a server that died asleep
is relaunched at the next wake. A new server knows no adapter and no weight group, and gets the
current weights (``_sync_weights``) before anything is served again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from appliance.engines.vllm_process import ServerProcess
from appliance.engines.vllm_weights import VLLMWeights
from contracts.errors import ApplianceError

log = logging.getLogger(__name__)

#: Consecutive failed restarts after which the supervisor gives up (each waits longer).
MAX_RESTART_FAILURES = 5


class VLLMSupervisor(VLLMWeights):
    """``VLLMEngine``'s supervisor (a part of the engine, not an engine)."""

    _log_path: Path
    _startup_timeout_s: float
    _session: aiohttp.ClientSession | None
    _failed: str | None
    _holds_gpu: asyncio.Event
    _relaunching: asyncio.Lock
    _relaunch_tried: asyncio.Event | None
    restarts: int

    if TYPE_CHECKING:

        @property
        def server_pid(self) -> int | None: ...

        def _new_server(self, port: int) -> ServerProcess: ...

        async def _read_server_info(self) -> None: ...

    async def _supervise(self) -> None:
        """Restart the server whenever it exits, then give it the current weights again."""
        while True:
            assert self._server is not None
            status = await self._server.wait()
            self._down = f"the server exited with status {status} and is restarting"
            log.warning("vLLM server exited with status %s; restarting (log: %s)", status, self._log_path)
            await self._server.stop()  # what is left of its process group
            started = time.monotonic()
            failures = 0
            while not await self._relaunch():
                failures += 1
                if failures >= MAX_RESTART_FAILURES:
                    self._failed = f"gave up after {failures} failed restarts; see {self._log_path}"
                    log.error("vLLM: %s", self._failed)
                    return
                await asyncio.sleep(min(30.0, 2.0**failures))
            self.restarts += 1
            self.switch_times["restart"] = time.monotonic() - started
            log.info("vLLM restarted in %.1f s (pid %s)", self.switch_times["restart"], self.server_pid)

    async def _relaunch(self) -> bool:
        """One attempt (``_restart``), made while the engine holds its GPU: a server that died
        asleep waits for the next wake, since until then a collocated trainer holds the memory
        that a new server asks for (vLLM wants ``gpu_memory_utilization`` of the GPU's total
        free, whatever else is on it)."""
        while True:
            if not self._holds_gpu.is_set():
                self._down = "the server exited while the engine slept; it is relaunched at the next wake"
                log.warning("vLLM: %s", self._down)
                self._relaunch_tried = asyncio.Event()
                await self._holds_gpu.wait()
            async with self._relaunching:
                if not self._holds_gpu.is_set():  # put to sleep again meanwhile
                    continue
                try:
                    return await self._restart()
                finally:
                    if self._relaunch_tried is not None:
                        self._relaunch_tried.set()
                        self._relaunch_tried = None

    async def _restart(self) -> bool:
        """One attempt: a new server (on the same socket, or a fresh port) with the weights. It is
        launched only while the engine holds its GPU (``_relaunch``), so it stays awake: a wake
        under way finds it so."""
        assert self._session is not None
        try:
            self._server = self._new_server(0)
            await self._server.start(self._session, self._startup_timeout_s)
            await self._read_server_info()
            async with self._gate.exclusive():
                self._down = None
                self._push_pending = self._push_pending or self._weights_dir is not None or self._weights_gone
                # A new server knows no adapter.
                self._adapter_name, self._adapter_pending = None, self._adapter_dir is not None
                self._in_group = False  # nor the weight group
                self._released.clear()  # awake: the wake that let it start is under way
                await self._sync_weights()
        except Exception as exc:
            # Anything (not only EngineUnavailable: a launch that raises OSError, a /v1/models
            # answer of an odd shape) is one failed attempt; the supervisor must not die of it,
            # or the engine would stay "restarting" for ever.
            message = exc.message if isinstance(exc, ApplianceError) else f"{type(exc).__name__}: {exc}"
            self._down = f"a restart failed: {message}"
            log.error("vLLM restart failed: %s", message)
            if self._server is not None:
                await self._server.stop()
            return False
        return True
