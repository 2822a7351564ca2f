"""Published weights: a push's buckets written once to a directory that replicas pull over HTTP.

Owns turning a bucketed weight push (``trainer.buckets``: one reusable shared-memory file,
overwritten bucket by bucket) into files that outlive it: each bucket's bytes as
``bucket-<index>.bin`` (the bucket's own layout: every tensor at its offset, the gaps zero, so
the same weights always give the same file), and ``manifest.json`` naming each file with its
size, its SHA-256 and its tensor entries (``[name, dtype, shape, offset, nbytes]``, what the
worker's ``_appliance_load`` takes), under ``<root>/v<version>/``, owner-only. It also owns
which versions are kept, and sharing one write among several consumers of the same push (the
fleet's tee gives every replica a stream: the first to ask writes, the others drain theirs and
wait for it), and showing a version while it is written: each file is listed (``files_of``) and
served (``file_path``) as soon as it is whole and hashed, so a server pulls file i while file
i+1 is written. Serving the files is ``appliance.proxy.weights``; asking a server to pull them is
``appliance.engines.vllm_pull``; the download itself runs in vLLM's worker (``vllm_worker``).

Invariants: a version directory exists only once complete (written under ``.tmp-*`` and
renamed on the event loop's thread, so a path looked up and opened there is never renamed in
between; a write that fails leaves nothing); a file is listed only once all its bytes are
written and its digest known, and a version's readers learn whether its write completed or
failed (``PublicationFailed``), never an end they could take for complete; ``current`` is the
newest complete version; the newest ``keep`` versions stay, and so does any version pinned
(``pinned``: a pull in progress), so a reader never loses a file under it. A version published
again with the same bytes keeps its directory; with other bytes it is replaced (a reader of the
old one then sees a digest mismatch, never a mix it could load).
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
from dataclasses import dataclass, field
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


class PublicationFailed(RuntimeError):
    """The write of a version its reader was following failed (nothing of it is published)."""


@dataclass(slots=True)
class _Progress:
    """A version being written: its temporary directory, the files whole so far, and how the
    write ended (``done``, or ``error``); ``changed`` is set (and replaced) at every change."""

    directory: Path | None = None
    files: list[PublishedFile] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def tell(self) -> None:
        """Wake the readers waiting for a change (they wait on the event they saw)."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


def _owner_only_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


def copy_bucket(bucket: WeightBucket, path: Path) -> None:
    """Copy ``bucket``'s entries from its file into ``path`` (owner-only), each at its offset with
    zeros between them (the file is sized first, so the gaps are never written). Not synced to
    disk: the digests, not the file system, say whether a file is whole (a version cut short by
    a crash is refused at its pull, and the next push publishes again)."""
    end = bucket.end
    spans = sorted(((e.offset, e.nbytes) for e in bucket.entries if e.nbytes), key=lambda span: span[0])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, end)
        if not end:
            return
        with (
            Path(bucket.path).open("rb") as source,
            mmap.mmap(source.fileno(), end, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as raw,
        ):
            for offset, nbytes in spans:
                for start in range(offset, offset + nbytes, _CHUNK):
                    with raw[start : min(start + _CHUNK, offset + nbytes)] as chunk:
                        done = 0
                        while done < len(chunk):
                            done += os.pwrite(fd, chunk[done:], start + done)
    finally:
        os.close(fd)


def hash_bucket_file(path: Path, bucket: WeightBucket) -> PublishedFile:
    """``path`` (a copy of ``bucket``: ``copy_bucket``) as a manifest lists it, its SHA-256 read
    from the copy, so the bucket's own file is free again before the hash is done."""
    digest = hashlib.sha256()
    if bucket.end:
        with (
            path.open("rb") as source,
            mmap.mmap(source.fileno(), bucket.end, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as raw,
        ):
            for start in range(0, bucket.end, _CHUNK):
                with raw[start : min(start + _CHUNK, bucket.end)] as chunk:
                    digest.update(chunk)  # hashlib lets go of the GIL for large updates
    return PublishedFile(path.name, bucket.end, digest.hexdigest(), bucket.entries)


def write_bucket_file(bucket: WeightBucket, path: Path) -> PublishedFile:
    """``copy_bucket`` and then ``hash_bucket_file``: one bucket published in one call."""
    copy_bucket(bucket, path)
    return hash_bucket_file(path, bucket)


async def _listed(
    previous: asyncio.Future[None] | None, path: Path, bucket: WeightBucket, progress: _Progress
) -> None:
    """Hash the copy at ``path`` and list it, after the file before it (``previous``)."""
    file = await asyncio.to_thread(hash_bucket_file, path, bucket)
    if previous is not None:
        await previous
    progress.files.append(file)
    progress.tell()


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
        #: What their readers see of them: the files whole so far.
        self._progress: dict[int, _Progress] = {}
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

    def writing(self, version: int) -> bool:
        """Whether ``version`` is being written now (its files can be followed: ``files_of``)."""
        return version in self._progress

    def known(self, version: int) -> bool:
        """Whether ``version`` is published or being written."""
        return version in self._manifests or version in self._progress

    def file_path(self, version: int, name: str) -> Path | None:
        """The path of file ``name`` of ``version``: only a name its manifest lists (so no name
        from a request reaches the file system unchecked), or, while the version is written,
        a file already whole; None for any other (a file still being written included). The
        path stays valid until the event loop runs on: open it before awaiting anything."""
        progress = self._progress.get(version)
        directory = progress.directory if progress is not None else None
        if progress is not None and directory is not None and any(f.name == name for f in progress.files):
            return directory / name
        manifest = self._manifests.get(version)
        if manifest is None or manifest.file(name) is None:
            return None
        return self.root / f"v{version}" / name

    async def files_of(self, version: int) -> AsyncIterator[PublishedFile]:
        """The files of ``version`` in load order, each as soon as it is whole: all at once for
        a published version, one by one as they are written for a version being written (its
        end awaited). Raises ``KeyError`` for a version neither, and ``PublicationFailed`` when
        the write it follows fails (after the files it listed: none of them may be loaded)."""
        progress = self._progress.get(version)
        if progress is None:
            manifest = self._manifests.get(version)
            if manifest is None:
                raise KeyError(version)
            for file in manifest.files:
                yield file
            return
        listed = 0
        while True:
            changed = progress.changed
            while listed < len(progress.files):
                listed += 1
                yield progress.files[listed - 1]
            if progress.error is not None:
                raise PublicationFailed(progress.error)
            if progress.done:
                return
            await changed.wait()

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
        return await self.begin(buckets, version)

    def begin(self, buckets: AsyncIterator[WeightBucket], version: int) -> asyncio.Task[Manifest]:
        """``publish`` as a task; the version is announced (``writing``, ``files_of``) by the
        time this returns, so a reader can follow it at once. Call it in the event loop."""
        writing = self._writing.get(version)
        if writing is not None:
            return asyncio.ensure_future(self._drain(buckets, writing))
        future: asyncio.Future[Manifest] = asyncio.get_running_loop().create_future()
        self._writing[version] = future
        progress = self._progress[version] = _Progress()
        task = asyncio.ensure_future(self._publish(buckets, version, future, progress))
        task.add_done_callback(lambda _: self._forget(version, future, progress))
        return task

    @staticmethod
    async def _drain(buckets: AsyncIterator[WeightBucket], writing: asyncio.Future[Manifest]) -> Manifest:
        try:
            async for _ in buckets:
                pass
        finally:
            await close_stream(buckets)
        return await asyncio.shield(writing)

    async def _publish(
        self,
        buckets: AsyncIterator[WeightBucket],
        version: int,
        future: asyncio.Future[Manifest],
        progress: _Progress,
    ) -> Manifest:
        try:
            manifest = await self._write(buckets, version, progress)
        except BaseException as exc:
            self._fail(version, future, progress, exc)
            raise
        finally:
            await close_stream(buckets)
        progress.done = True
        progress.tell()
        future.set_result(manifest)
        return manifest

    def _fail(
        self, version: int, future: asyncio.Future[Manifest], progress: _Progress, exc: BaseException
    ) -> None:
        """The write of ``version`` ended without a manifest: its readers and waiters told."""
        progress.error = f"writing weights v{version} failed: {type(exc).__name__}: {exc}"
        progress.tell()
        if not future.done():
            cause = exc if isinstance(exc, Exception) else RuntimeError("the write was cancelled")
            future.set_exception(cause)
            future.exception()  # retrieved: the waiters, if any, get it too
        self._forget(version, future, progress)

    def _forget(self, version: int, future: asyncio.Future[Manifest], progress: _Progress) -> None:
        """No longer announce this write of ``version`` (a task cancelled before its first step
        never ran ``_publish``: its readers are told here)."""
        if self._writing.get(version) is future:
            del self._writing[version]
            del self._progress[version]
        if not future.done():
            self._fail(version, future, progress, asyncio.CancelledError())

    async def _write(
        self, buckets: AsyncIterator[WeightBucket], version: int, progress: _Progress
    ) -> Manifest:
        loop = asyncio.get_running_loop()
        started = loop.time()
        temporary = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".tmp-", dir=self.root))
        progress.directory = temporary
        listed: asyncio.Future[None] | None = None
        try:
            files = progress.files
            # Each bucket is copied while the push waits; its hash is read from the copy while the
            # next bucket is packed, and the file listed (in order) once it is known.
            index = 0
            async for bucket in buckets:
                if bucket.via_group:
                    raise ValueError(
                        "a push broadcast over a weight group cannot be published (no file holds it)"
                    )
                path = temporary / FILE_NAME.format(index=index)
                index += 1
                await asyncio.to_thread(copy_bucket, bucket, path)
                listed = asyncio.ensure_future(_listed(listed, path, bucket, progress))
                if bucket.last:
                    break
            else:
                raise ValueError("the weight buckets ended before their last bucket")
            await listed
            manifest = Manifest(version, tuple(files))
            await asyncio.to_thread(self._write_manifest, temporary, manifest)
            retired = self._swap_in(temporary, manifest)  # on this thread: see ``file_path``
        except BaseException:
            if listed is not None:  # the hashes under way end first (their errors are this one's)
                await asyncio.wait([listed])
                if not listed.cancelled():
                    listed.exception()
            await asyncio.to_thread(shutil.rmtree, temporary, True)
            raise
        progress.directory = self.root / f"v{version}"  # the same files, where they are now
        self._manifests[version] = manifest
        await asyncio.to_thread(self._settle, retired)
        self._prune()
        self.last_write_s = loop.time() - started
        log.info("published weights v%d: %d files, %d bytes", version, len(files), manifest.bytes)
        return manifest

    @staticmethod
    def _write_manifest(temporary: Path, manifest: Manifest) -> None:
        fd = os.open(temporary / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(manifest.to_json(), out)
            out.flush()
            os.fsync(out.fileno())
        temporary.chmod(0o700)

    def _swap_in(self, temporary: Path, manifest: Manifest) -> Path | None:
        """Make ``temporary`` the version's directory (if the version is already published with
        the same bytes, the directory stays and ``temporary`` goes); returns the directory left
        to remove. Renames only: run on the event loop's thread, between two of its steps."""
        final = self.root / f"v{manifest.version}"
        retired: Path | None = None
        if final.exists():
            if self._manifests.get(manifest.version) == manifest:
                return temporary
            retired = temporary.with_name(f".tmp-retired{temporary.name}")
            final.rename(retired)
        temporary.rename(final)
        return retired

    def _settle(self, retired: Path | None) -> None:
        """After ``_swap_in``: the rename made durable where the file system can, and what it
        left removed."""
        with contextlib.suppress(OSError):
            dir_fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)

    def _prune(self) -> None:
        """Remove complete versions older than the newest ``keep`` that nobody has pinned."""
        for version in sorted(self._manifests)[: -self.keep]:
            if self._pins[version] > 0:
                continue
            self._pins.pop(version, None)
            del self._manifests[version]
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
