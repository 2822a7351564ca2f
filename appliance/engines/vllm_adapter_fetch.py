"""Fetching a published LoRA adapter over HTTP, inside vLLM's worker (standard library only).

Owns the download behind ``ApplianceWorkerExtension.appliance_pull_adapter``: the files of an
adapter version (``appliance.engines.adapter_publication``, served at
``/admin/adapters/v<version>/<name>`` with the admin token) into a directory of the server's
own, each retried with doubling backoff on what a retry can change and checked against its
SHA-256; the directory's path is what vLLM's ``/v1/load_lora_adapter`` is then given by the
appliance, as for a local load. The newest ``KEEP`` directories a worker fetched stay (the one
served and the one before it), older ones go. Like the worker extension, this file imports
nothing from the appliance: it is copied beside it into the server's ``PYTHONPATH``
(``vllm_process.install_worker_extension``) as the module ``appliance_vllm_adapter_fetch``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: HTTP answers a retry cannot change (the token, the version or the file is wrong).
FINAL_HTTP = frozenset({400, 401, 403, 404, 410})
#: Adapter directories a worker keeps (the newest ones it fetched).
KEEP = 2
#: The worker attribute listing the directories it fetched, oldest first.
_FETCHED = "_appliance_adapter_dirs"
#: The environment variable naming where the directories go (the server's own directory, which
#: its launcher removes when it stops, so a killed server leaves none behind); unset: $TMPDIR.
ROOT_ENV = "APPLIANCE_ADAPTER_DIR"


class AdapterPullError(RuntimeError):
    """An adapter file could not be had, or arrived with another digest."""


def pull_adapter(worker: Any, spec_json: str) -> dict[str, Any]:
    """Download the adapter ``spec_json`` names (``{"url", "token", "version", "files": [{"name",
    "bytes", "sha256"}], "retries"?, "backoff_s"?, "timeout_s"?}``) into a new directory; its
    ``path``, ``bytes`` and ``seconds``."""
    spec = json.loads(spec_json)
    started = time.monotonic()
    base = f"{str(spec['url']).rstrip('/')}/admin/adapters/v{int(spec['version'])}"
    root = os.environ.get(ROOT_ENV) or None
    if root is not None:
        Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="appliance-adapter-", dir=root))
    try:
        total = 0
        for file in spec["files"]:
            data = _fetch(f"{base}/{file['name']}", spec)
            if len(data) != int(file["bytes"]) or hashlib.sha256(data).hexdigest() != file["sha256"]:
                raise AdapterPullError(
                    f"adapter v{spec['version']}: {file['name']} arrived with another size or SHA-256"
                )
            (directory / str(file["name"])).write_bytes(data)
            total += len(data)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    fetched: list[str] = getattr(worker, _FETCHED, [])
    fetched.append(str(directory))
    for old in fetched[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    setattr(worker, _FETCHED, fetched[-KEEP:])
    return {"path": str(directory), "bytes": total, "seconds": time.monotonic() - started}


def _fetch(url: str, spec: dict[str, Any]) -> bytes:
    """One file's bytes, retried ``retries`` times with doubling ``backoff_s``."""
    retries, backoff = int(spec.get("retries", 4)), float(spec.get("backoff_s", 0.5))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {spec['token']}"})
    name = url.rsplit("/", 1)[-1]
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=float(spec.get("timeout_s", 60.0))) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code in FINAL_HTTP or attempt == retries:
                raise AdapterPullError(f"adapter file {name}: HTTP {exc.code}") from None
        except (OSError, urllib.error.URLError) as exc:
            if attempt == retries:
                raise AdapterPullError(f"adapter file {name}: {type(exc).__name__}: {exc}") from None
        time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")
