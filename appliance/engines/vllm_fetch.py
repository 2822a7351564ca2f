"""Fetching a published weight version over HTTP, inside vLLM's worker (standard library only).

Owns the download half of ``ApplianceWorkerExtension.appliance_pull_weights``
(``appliance.engines.vllm_worker``): the files of a version published by
``appliance.engines.weight_publication`` and served by ``appliance.proxy.weights``, fetched with
``urllib`` a few at a time, each retried with doubling backoff on what a retry can change (a
connection error, a 5xx, a short body) and checked against its SHA-256 as it arrives, into a
directory that has room for them. A version still being written is followed as it grows
(``fetch_streamed``: the route that lists each file once it is whole), each file fetched as
soon as it is listed, so the appliance writes file i+1 while file i comes over and is hashed
here; the pull is done only once the listing said the version is complete and every file
arrived with its digest. Loading them into the model is the worker extension's. Like it, this file
imports nothing from the appliance and nothing outside the standard library: it is copied next
to it into the server's ``PYTHONPATH`` (``vllm_process.install_worker_extension``), where it is
the module ``appliance_vllm_fetch``. Its errors name a file by its name, not its URL: vLLM
replaces what looks like a path in a worker's error with "<path>".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: HTTP answers a retry cannot change (the token, the version or the file is wrong).
FINAL_HTTP = frozenset({400, 401, 403, 404, 410})
#: Where pulled files wait to be loaded (else /dev/shm when it has room, else the temp dir).
PULL_DIR_ENV = "APPLIANCE_PULL_DIR"
#: Bytes read from the connection at a time.
CHUNK = 4 << 20


class PullError(RuntimeError):
    """A published version could not be pulled (the message says which file and why)."""


def _request(url: str, spec: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {spec['token']}"})


def fetch_json(url: str, spec: dict[str, Any]) -> Any:
    """The JSON at ``url`` (a version's manifest), with the spec's token."""
    try:
        with urllib.request.urlopen(_request(url, spec), timeout=float(spec.get("timeout_s", 60))) as answer:
            return json.load(answer)
    except (OSError, ValueError) as exc:  # HTTPError and URLError are OSErrors
        raise PullError(f"GET {url}: {exc}") from exc


def pull_root(total: int, wanted: str | None = None) -> str:
    """Where the pulled files wait: ``wanted``, else ``$APPLIANCE_PULL_DIR``, else /dev/shm if it
    has room for them (and a quarter more), else the temp directory; raises if that lacks room."""
    root = wanted or os.environ.get(PULL_DIR_ENV)
    if root is None:
        roomy = Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > total * 1.25
        root = "/dev/shm" if roomy else tempfile.gettempdir()
    free = shutil.disk_usage(root).free
    if free < total:
        raise PullError(f"{root} has {free} bytes free; the pulled weights need {total} (set {PULL_DIR_ENV})")
    return root


def fetch_file(url: str, file: dict[str, Any], path: Path, spec: dict[str, Any]) -> Path:
    """Download ``url`` to ``path``: retried (``retries`` more times, 4 by default, after
    ``backoff_s`` (0.5) doubled each time) on a connection error, a 5xx, a 408/429 or a short
    body; a final 4xx (``FINAL_HTTP``) or a SHA-256 other than ``file["sha256"]`` raise at once."""
    retries, backoff = int(spec.get("retries", 4)), float(spec.get("backoff_s", 0.5))
    timeout = float(spec.get("timeout_s", 60))
    attempt = 0
    while True:
        digest, size = hashlib.sha256(), 0
        buffer = memoryview(bytearray(CHUNK))  # one buffer, read into again and again
        try:
            with (
                urllib.request.urlopen(_request(url, spec), timeout=timeout) as answer,
                path.open("wb", buffering=0) as out,
            ):
                while read := answer.readinto(buffer):
                    chunk = buffer[:read]
                    out.write(chunk)
                    digest.update(chunk)
                    size += read
            if size != int(file["bytes"]):
                raise ConnectionError(f"the body ended after {size} of {file['bytes']} bytes")
        except OSError as exc:  # HTTPError, URLError, ConnectionError, TimeoutError
            if attempt == retries or getattr(exc, "code", None) in FINAL_HTTP:
                raise PullError(
                    f"file {file['name']} could not be fetched ({attempt + 1} tries): {exc}"
                ) from exc
            time.sleep(backoff * 2**attempt)
            attempt += 1
            continue
        if digest.hexdigest() != file["sha256"]:
            raise PullError(
                f"file {file['name']}: its SHA-256 {digest.hexdigest()} is not the manifest's "
                f"{file['sha256']} (the file changed or was corrupted); nothing was loaded"
            )
        return path


def fetch_streamed(
    base: str, directory: Path, spec: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[Path]]:
    """Every file of a version (``<base>/<name>``), each fetched (``threads`` at a time) as
    soon as ``<base>/files`` lists it, into ``directory``; returns the files (the listing's
    entries, in load order) and their paths once the listing ended complete and every file
    arrived checked. A listing that ends in an error or is cut short (retried like a file,
    resuming after the files it had listed) raises once the downloads under way have ended."""
    retries, backoff = int(spec.get("retries", 4)), float(spec.get("backoff_s", 0.5))
    timeout = float(spec.get("timeout_s", 60))
    threads = max(1, int(spec.get("threads", 4)))
    files: list[dict[str, Any]] = []
    downloads: list[Future[Path]] = []
    with ThreadPoolExecutor(threads, thread_name_prefix="appliance-pull") as pool:
        try:
            attempt = 0
            while True:
                try:
                    end = _follow(base, spec, timeout, files, downloads, pool, directory)
                    break
                except OSError as exc:
                    if attempt == retries or getattr(exc, "code", None) in FINAL_HTTP:
                        raise PullError(
                            f"the listing of {base}/files failed ({attempt + 1} tries): {exc}"
                        ) from exc
                    time.sleep(backoff * 2**attempt)
                    attempt += 1
            if "error" in end:
                raise PullError(
                    f"the appliance could not publish the version: {end['error']}; nothing was loaded"
                )
            if int(end["files"]) != len(files):
                raise PullError(f"the listing ended with {end['files']} files, {len(files)} listed")
            return files, [download.result() for download in downloads]
        except BaseException:
            for download in downloads:
                download.cancel()
            raise


def _follow(
    base: str,
    spec: dict[str, Any],
    timeout: float,
    files: list[dict[str, Any]],
    downloads: list[Future[Path]],
    pool: ThreadPoolExecutor,
    directory: Path,
) -> dict[str, Any]:
    """Read the listing at ``<base>/files``, starting the download of each file not had yet;
    returns its last line (how the version's write ended); a cut-off body raises
    ``ConnectionError``."""
    with urllib.request.urlopen(_request(f"{base}/files", spec), timeout=timeout) as answer:
        for raw in answer:
            line = json.loads(raw)
            if "name" not in line:
                return dict(line)
            names = {f["name"] for f in files}
            if line["name"] not in names:
                files.append(line)
                path = directory / Path(line["name"]).name
                downloads.append(pool.submit(fetch_file, f"{base}/{line['name']}", line, path, spec))
            if any(d.done() and d.exception() is not None for d in downloads):
                break  # a file failed: no use waiting for the rest of the listing
    failed = next((d for d in downloads if d.done() and d.exception() is not None), None)
    if failed is not None:
        failed.result()  # raises its PullError (not an OSError: no retry)
    raise ConnectionError("the listing ended before it said whether the version is complete")


def fetch_files(base: str, files: list[dict[str, Any]], directory: Path, spec: dict[str, Any]) -> list[Path]:
    """Every file of a version (``<base>/<name>``) into ``directory``, ``threads`` (4) at a time;
    the first failure raises, once the downloads under way have ended."""
    jobs = [(f"{base}/{f['name']}", f, directory / Path(f["name"]).name, spec) for f in files]
    threads = max(1, int(spec.get("threads", 4)))
    with ThreadPoolExecutor(threads, thread_name_prefix="appliance-pull") as pool:
        return list(pool.map(lambda job: fetch_file(*job), jobs))
