"""Published weights: a push's buckets written once to a directory that replicas pull over HTTP.

Owns turning a bucketed weight push (``trainer.buckets``: one reusable shared-memory file,
overwritten bucket by bucket) into files that outlive it: each bucket's bytes as
``bucket-<index>.bin`` (the bucket's own layout: every tensor at its offset, the gaps zero, so
the same weights always give the same file), and ``manifest.json`` naming each file with its
size, its SHA-256 and its tensor entries (``[name, dtype, shape, offset, nbytes]``, what the
worker's ``_appliance_load`` takes), under ``<root>/v<version>/``, owner-only. It also owns
which versions are kept, and sharing one write among several consumers of the same push (the
fleet's tee gives every replica a stream: the first to ask writes, the others drain theirs and
wait for it). Serving the files is ``appliance.proxy.weights``; asking a server to pull them is
``appliance.engines.vllm_pull``; the download itself runs in vLLM's worker (``vllm_worker``).

Invariants: a version directory exists only once complete (written under ``.tmp-*`` and
renamed; a write that fails leaves nothing); ``current`` is the newest complete version; the
newest ``keep`` versions stay, and so does any version pinned (``pinned``: a pull in progress),
so a reader never loses a file under it. A version published again with the same bytes keeps
its directory; with other bytes it is replaced (a reader of the old one then sees a digest
mismatch, never a mix it could load).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.buckets import TensorEntry, WeightBucket, close_stream

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: A version's directory name, and a bucket file's.
_VERSION_DIR = re.compile(r"^v(\d+)$")
FILE_NAME = "bucket-{index:05d}.bin"
#: Bytes read from the bucket file per copy.
_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class PublishedFile:
    """One bucket of a published version."""

    name: str
    bytes: int
    sha256: str
    entries: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        entries = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256, "entries": entries}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PublishedFile:
        entries = tuple(
            TensorEntry(str(n), str(d), tuple(int(s) for s in shape), int(o), int(b))
            for n, d, shape, o, b in data["entries"]
        )
        return cls(str(data["name"]), int(data["bytes"]), str(data["sha256"]), entries)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a published version holds: its files, in the order they are loaded."""

    version: int
    files: tuple[PublishedFile, ...]

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def file(self, name: str) -> PublishedFile | None:
        return next((f for f in self.files if f.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "bytes": self.bytes, "files": [f.to_json() for f in self.files]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(int(data["version"]), tuple(PublishedFile.from_json(f) for f in data["files"]))


def _owner_only_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


def write_bucket_file(bucket: WeightBucket, path: Path) -> PublishedFile:
    """Copy ``bucket``'s entries from its file into ``path`` (owner-only), each at its offset
    with zeros between them, hashing the result as it is written. Not synced to disk: the
    digests, not the file system, say whether a file is whole (a version cut short by a crash
    is refused at its pull, and the next push publishes again)."""
    digest = hashlib.sha256()
    end = bucket.end
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        if end:
            with (
                Path(bucket.path).open("rb") as source,
                mmap.mmap(source.fileno(), end, access=mmap.ACCESS_READ) as mapped,
                memoryview(mapped) as raw,
            ):
                written = 0
                for entry in sorted(bucket.entries, key=lambda e: e.offset):
                    if entry.nbytes == 0:
                        continue
                    gap = bytes(entry.offset - written)
                    out.write(gap)
                    digest.update(gap)
                    for start in range(entry.offset, entry.offset + entry.nbytes, _CHUNK):
                        with raw[start : min(start + _CHUNK, entry.offset + entry.nbytes)] as chunk:
                            out.write(chunk)
                            digest.update(chunk)
                    written = entry.offset + entry.nbytes
                tail = bytes(end - written)
                out.write(tail)
                digest.update(tail)
    return PublishedFile(path.name, end, digest.hexdigest(), bucket.entries)


class WeightPublication:
    """The published versions under ``root`` (created owner-only; a complete version found there
    is served again). ``keep`` (at least 1) is how many of the newest versions stay."""

    def __init__(self, root: Path, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        _owner_only_dir(self.root)
        for stale in self.root.glob(".tmp-*"):  # a write cut off by a crash
            shutil.rmtree(stale, ignore_errors=True)
        self._manifests: dict[int, Manifest] = {}
        for directory in self.root.iterdir():
            match = _VERSION_DIR.match(directory.name)
            if match and (directory / MANIFEST).is_file():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    manifest = Manifest.from_json(json.loads((directory / MANIFEST).read_text()))
                    self._manifests[int(match[1])] = manifest
        #: Versions being written now: what their other consumers wait for.
        self._writing: dict[int, asyncio.Future[Manifest]] = {}
        self._pins: Counter[int] = Counter()
        #: Seconds the last write took (consuming the stream included).
        self.last_write_s = 0.0

    @property
    def current(self) -> Manifest | None:
        """The newest complete version's manifest; None before the first publication."""
        return self._manifests[max(self._manifests)] if self._manifests else None

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._manifests))

    def manifest(self, version: int) -> Manifest | None:
        return self._manifests.get(version)

    def file_path(self, version: int, name: str) -> Path | None:
        """The path of file ``name`` of ``version``: only a name its manifest lists (so no name
        from a request reaches the file system unchecked); None for any other."""
        manifest = self._manifests.get(version)
        if manifest is None or manifest.file(name) is None:
            return None
        return self.root / f"v{version}" / name

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[None]:
        """Keep ``version`` (if published) while the block runs, however many newer ones come."""
        self._pins[version] += 1
        try:
            yield
        finally:
            self._pins[version] -= 1
            if self._pins[version] <= 0:
                del self._pins[version]
            self._prune()

    async def publish(self, buckets: AsyncIterator[WeightBucket], version: int) -> Manifest:
        """Write the push ``buckets`` as ``version`` and return its manifest; the stream is
        closed when this returns. If ``version`` is being written by another consumer of the
        same push already, this stream is drained (so a tee feeding both moves on) and that
        write's manifest returned (its error raised)."""
        writing = self._writing.get(version)
        if writing is not None:
            try:
                async for _ in buckets:
                    pass
            finally:
                await close_stream(buckets)
            return await asyncio.shield(writing)
        future: asyncio.Future[Manifest] = asyncio.get_running_loop().create_future()
        self._writing[version] = future
        try:
            manifest = await self._write(buckets, version)
        except BaseException as exc:
            future.set_exception(
                exc if isinstance(exc, Exception) else RuntimeError("the write was cancelled")
            )
            future.exception()  # retrieved: the waiters, if any, get it too
            raise
        finally:
            del self._writing[version]
            await close_stream(buckets)
        future.set_result(manifest)
        return manifest

    async def _write(self, buckets: AsyncIterator[WeightBucket], version: int) -> Manifest:
        loop = asyncio.get_running_loop()
        started = loop.time()
        temporary = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".tmp-", dir=self.root))
        try:
            files: list[PublishedFile] = []
            async for bucket in buckets:
                if bucket.via_group:
                    raise ValueError(
                        "a push broadcast over a weight group cannot be published (no file holds it)"
                    )
                path = temporary / FILE_NAME.format(index=len(files))
                files.append(await asyncio.to_thread(write_bucket_file, bucket, path))
                if bucket.last:
                    break
            else:
                raise ValueError("the weight buckets ended before their last bucket")
            manifest = Manifest(version, tuple(files))
            await asyncio.to_thread(self._complete, temporary, manifest)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, temporary, True)
            raise
        self._manifests[version] = manifest
        self._prune()
        self.last_write_s = loop.time() - started
        log.info("published weights v%d: %d files, %d bytes", version, len(files), manifest.bytes)
        return manifest

    def _complete(self, temporary: Path, manifest: Manifest) -> None:
        """Write the manifest into ``temporary`` and make it the version's directory (kept as
        it is if the version is already published with the same bytes)."""
        fd = os.open(temporary / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(manifest.to_json(), out)
            out.flush()
            os.fsync(out.fileno())
        temporary.chmod(0o700)
        final = self.root / f"v{manifest.version}"
        if final.exists():
            if self._manifests.get(manifest.version) == manifest:
                shutil.rmtree(temporary, ignore_errors=True)
                return
            retired = Path(tempfile.mkdtemp(prefix=".tmp-retired-", dir=self.root))
            final.rename(retired / final.name)
            temporary.rename(final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            temporary.rename(final)
        with contextlib.suppress(OSError):  # the rename made durable where the file system can
            dir_fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _prune(self) -> None:
        """Remove complete versions older than the newest ``keep`` that nobody has pinned."""
        for version in sorted(self._manifests)[: -self.keep]:
            if self._pins[version] > 0:
                continue
            self._pins.pop(version, None)
            del self._manifests[version]
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
