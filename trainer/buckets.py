"""Weight buckets: a model's tensors streamed through one reusable shared-memory file.

Owns the wire format of a bucketed weight push (``TensorEntry``, ``WeightBucket``, and
``LoraAdapter`` for a push that carries a LoRA adapter instead of whole weights), the file that
carries the bytes (``BucketBuffer``), the layout (``lay_out``: where each tensor goes), the
producer (``pack_buckets``: copies tensors into the file, one bucket at a time), the consumer's
view of a bucket (``bucket_tensors``: zero-copy CPU tensors over the file), and the hand-over
between a producer and an async consumer (``stream_buckets``, ``close_stream``). It knows
nothing about models, trainers or engines: which tensors go in (the trainer's
``weight_buckets``) and where they land (``Engine.load_weight_buckets``) are theirs.

Why: a full copy of a model's state dict on the host (and a second one as a safetensors file
in ``/dev/shm``) costs twice the model in host memory per push. Buckets cost one bucket: the
producer fills the file, the consumer (this process or vLLM's) maps it and copies the tensors
where they belong, then the producer overwrites the same file with the next bucket.

Invariants: every tensor's bytes start at a multiple of ``ALIGN`` (so any dtype can be viewed
in place); a bucket's bytes stay as they are until the producer is resumed, and not longer; a
push ends with exactly one bucket whose ``last`` is True; the file is unlinked when the producer
finishes, fails or is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

#: The byte alignment of every tensor in a bucket file (a cache line; a multiple of any
#: dtype's size, which viewing bytes as that dtype needs).
ALIGN = 64


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies in a bucket file."""

    #: The HF parameter name, e.g. "model.layers.0.mlp.up_proj.weight".
    name: str
    #: The torch dtype's name without "torch.", e.g. "float32", "bfloat16".
    dtype: str
    shape: tuple[int, ...]
    #: Byte offset in the bucket file (a multiple of ``ALIGN``).
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """What makes a push a LoRA adapter rather than whole weights: its entries are
    ``<module>.lora_A.weight`` (rank x in) and ``<module>.lora_B.weight`` (out x rank) for linear
    layers ``<module>`` of the served model, which computes ``W x + (alpha / rank) B A x`` with its
    own (base) ``W``; every other weight stays the base model's."""

    rank: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


#: The suffixes of an adapter push's entry names.
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def adapter_pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Per adapted module, the names of its A and B entries; a ValueError names an entry that is
    not an adapter's, or a module lacking one of its two."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        for kind, suffix in (("A", LORA_A), ("B", LORA_B)):
            if name.endswith(suffix):
                modules.setdefault(name.removesuffix(suffix), {})[kind] = name
                break
        else:
            raise ValueError(f"{name!r} is not a LoRA adapter weight (<module>.lora_A/B.weight)")
    lacking = sorted(module for module, parts in modules.items() if len(parts) != 2)
    if lacking:
        raise ValueError(f"LoRA modules {lacking[:3]} lack their A or B weight")
    return {module: (parts["A"], parts["B"]) for module, parts in modules.items()}


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """Some tensors of one push, in a file that the next bucket of the push overwrites."""

    #: A file (normally under /dev/shm) holding the bytes; the same file for every bucket.
    path: str
    entries: tuple[TensorEntry, ...]
    #: 0, 1, 2 ... within one push.
    index: int
    #: True on the push's final bucket.
    last: bool
    #: Set on every bucket of a push that carries a LoRA adapter (None: whole weights).
    adapter: LoraAdapter | None = None
    #: The bytes come by broadcast over the trainer's weight group (``trainer.weight_group``),
    #: not in a file (``path`` is empty): only a consumer in that group can take the bucket.
    via_group: bool = False

    @property
    def end(self) -> int:
        """The bucket's bytes: up to its last entry's end."""
        return max((entry.offset + entry.nbytes for entry in self.entries), default=0)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a name that is not a torch dtype is a ValueError."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def default_directory() -> Path:
    """Shared memory (``/dev/shm``) where there is one, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


#: The bucket files this process has open for writing, by path (``bucket_tensors`` reads a
#: bucket made in this process through the same mapping).
_OPEN: weakref.WeakValueDictionary[str, BucketBuffer] = weakref.WeakValueDictionary()


def aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of ``ALIGN`` (where the next tensor may start)."""
    return -(-offset // ALIGN) * ALIGN


def lay_out(
    tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, dtype: torch.dtype | None
) -> Iterator[tuple[torch.Tensor, torch.dtype, TensorEntry, bool]]:
    """The bucket layout of a push, a tensor at a time: its detached source, the dtype it is
    stored as (``dtype`` for a floating-point tensor, if given; else its own), its entry, and
    whether a new bucket starts with it (the current one has entries and this tensor would end
    past ``bucket_bytes``; a tensor larger than that gets a bucket of its own). Shared by the
    producers that fill a bucket (``pack_buckets``, ``trainer.weight_group.group_buckets``)."""
    used, placed = 0, False
    for name, tensor in tensors:
        source = tensor.detach()
        target = dtype if dtype is not None and source.is_floating_point() else source.dtype
        nbytes = source.numel() * target.itemsize
        offset = aligned(used)
        new_bucket = placed and offset + nbytes > bucket_bytes
        if new_bucket:
            offset = 0
        yield (
            source,
            target,
            TensorEntry(name, dtype_name(target), tuple(source.shape), offset, nbytes),
            new_bucket,
        )
        used, placed = offset + nbytes, True


class BucketBuffer:
    """A file of ``size`` bytes mapped read-write (shared, so other processes mapping the same
    file see what is written). ``grow`` enlarges it in place; ``close`` unlinks it."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = 0
        self._bytes: torch.Tensor | None = None
        self.grow(size)
        _OPEN[str(path)] = self

    @classmethod
    def create(cls, directory: Path | None = None, size: int = 0) -> BucketBuffer:
        """A new, uniquely named file in ``directory`` (default: ``default_directory()``)."""
        fd, name = tempfile.mkstemp(
            prefix="appliance-bucket-", suffix=".bin", dir=directory or default_directory()
        )
        os.close(fd)
        try:
            return cls(Path(name), size)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise

    @property
    def bytes(self) -> torch.Tensor:
        """The whole file as a uint8 tensor (writes go to the file)."""
        if self._bytes is None:
            raise ValueError(f"the bucket buffer {self.path} is closed")
        return self._bytes

    def grow(self, size: int) -> None:
        """Make the file at least ``size`` bytes; the mapping is replaced, the contents kept."""
        if self._bytes is not None and size <= self.size:
            return
        size = max(size, 1)  # an mmap cannot be empty
        os.truncate(self.path, size)
        # shared=True maps the file MAP_SHARED: writes land in the file itself (in /dev/shm,
        # the same pages other processes map), nothing is copied. The old mapping, if any, is
        # unmapped when its tensor is dropped.
        self._bytes = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        self.size = size

    def close(self) -> None:
        """Unlink the file and drop the mapping (views still held keep their pages). Idempotent."""
        self._bytes = None
        _OPEN.pop(str(self.path), None)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> BucketBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pack_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int,
    directory: Path | None = None,
    dtype: torch.dtype | None = None,
    adapter: LoraAdapter | None = None,
) -> Generator[WeightBucket, None, None]:
    """Copy tensors (any device; cast to `dtype` if given) into ONE reusable BucketBuffer file, yielding a
    WeightBucket each time it is full (and a final one with last=True). A bucket is valid until the
    generator is resumed (the consumer must be done with it before calling next()). A tensor larger
    than bucket_bytes gets a bucket of its own (the buffer grows to fit it). The file is unlinked when
    the generator finishes or is closed. directory None: /dev/shm if it is a directory, else tempfile's dir.
    Tensors sharing storage (tied embeddings) are the caller's business: pass each once.

    Only floating-point tensors are cast (an integer buffer keeps its dtype). Tensors are laid
    out in the order given, each at a multiple of ``ALIGN``; with no tensors at all the push is
    one empty bucket with last=True. ``adapter`` marks every bucket as part of a LoRA adapter
    push (see ``LoraAdapter``).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    buffer = BucketBuffer.create(directory, bucket_bytes)
    try:
        entries: list[TensorEntry] = []
        index = 0
        for source, target, entry, new_bucket in lay_out(tensors, bucket_bytes=bucket_bytes, dtype=dtype):
            if new_bucket:
                yield WeightBucket(str(buffer.path), tuple(entries), index, last=False, adapter=adapter)
                entries, index = [], index + 1
            end = entry.offset + entry.nbytes
            buffer.grow(end)
            destination = buffer.bytes[entry.offset : end].view(target).view(source.shape)
            # copy_ converts dtype and device on the way (a GPU tensor lands straight in the file).
            destination.copy_(source)
            entries.append(entry)
        yield WeightBucket(str(buffer.path), tuple(entries), index, last=True, adapter=adapter)
    finally:
        buffer.close()


def bucket_tensors(bucket: WeightBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy CPU tensor views of a bucket's entries (mmap the file read-only); the views are only
    valid while the bucket is.

    The file is mapped copy-on-write (``MAP_PRIVATE``): the views read the file's pages without
    copying them, and a write to a view, should a consumer make one, never reaches the file. A
    bucket written in this process is read through its writer's mapping instead (the same pages
    are not mapped twice); consumers only read.
    """
    if bucket.via_group:
        raise ValueError("this bucket's bytes are broadcast over a weight group, not in a file")
    end = bucket.end
    if end == 0:
        for entry in bucket.entries:  # only empty tensors
            yield entry.name, torch.empty(entry.shape, dtype=dtype_of(entry.dtype))
        return
    producer = _OPEN.get(bucket.path)
    if producer is not None and producer.size >= end:
        # Written in this process: read through the producer's own mapping (no second mapping
        # of the same pages, no page faults); the consumer only reads the views.
        raw = producer.bytes
    else:
        raw = torch.from_file(bucket.path, shared=False, size=end, dtype=torch.uint8)
    for entry in bucket.entries:
        view = raw[entry.offset : entry.offset + entry.nbytes].view(dtype_of(entry.dtype))
        yield entry.name, view.view(entry.shape)


async def stream_buckets(buckets: Iterator[WeightBucket]) -> AsyncGenerator[WeightBucket, None]:
    """``buckets`` (e.g. ``pack_buckets``' generator) as an async iterator for
    ``Engine.load_weight_buckets``: each ``next`` (the copies into the file) runs in a worker
    thread, so the event loop serves on meanwhile. When this iterator ends, fails or is closed,
    ``buckets`` is closed too (which unlinks the file), after any ``next`` still running in its
    thread has returned."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[WeightBucket | None] | None = None
    try:
        while True:
            pending = loop.run_in_executor(None, next, buckets, None)
            # Shielded: a cancelled consumer must not leave the thread running while the
            # generator is closed below (a running generator cannot be closed).
            bucket = await asyncio.shield(pending)
            pending = None
            if bucket is None:
                return
            yield bucket
    finally:
        if pending is not None:
            await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()  # retrieved: it is the cancelled consumer's, not news
        close = getattr(buckets, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


async def peek(
    buckets: AsyncIterator[WeightBucket],
) -> tuple[WeightBucket | None, AsyncGenerator[WeightBucket, None]]:
    """The first bucket of ``buckets`` (None if it has none) and a stream that yields it again,
    then the rest: a consumer can tell an adapter push from a whole-weights push before taking
    it. Closing the original stream is still the consumer's (``close_stream``)."""
    iterator = aiter(buckets)
    first = await anext(iterator, None)

    async def again() -> AsyncGenerator[WeightBucket, None]:
        if first is None:
            return
        yield first
        async for bucket in iterator:
            yield bucket

    return first, again()


async def close_stream(buckets: AsyncIterator[WeightBucket]) -> None:
    """Close a bucket stream its consumer is done with (``aclose``, where it has one), so that
    its producer unlinks the file now rather than when it is garbage collected."""
    aclose = getattr(buckets, "aclose", None)
    if aclose is not None:
        await aclose()
