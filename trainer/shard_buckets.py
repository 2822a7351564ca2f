"""A weight push from sharded trainer ranks: every rank writes its own rows into the bucket file.

Owns :func:`sharded_buckets`. FSDP2 shards each parameter along its first dimension, so a rank's
local shard is a contiguous run of rows of the whole tensor, and in a row-major bucket file a
contiguous run of bytes. Every rank computes the same layout (``trainer.buckets``'s
format: the whole tensors in order, each at a multiple of ``ALIGN``, a new bucket when the next
would not fit) from the global shapes alone, maps the one file rank 0 created, and copies its
rows to their place: nothing is gathered, no rank ever holds more than its shards, and the
host holds one bucket. Two barriers per bucket: all rows are written before rank 0 hands the
bucket on, and nobody overwrites it before the consumer is done (rank 0 resumes only then).

A tensor that is not sharded by rows (a replicated buffer, or another placement) is gathered
(``full_tensor``, a collective every rank makes in the same order) and written by rank 0.
It does not own the bucket format or the consumers (``trainer.buckets``, the
engines), nor which tensors are pushed (``trainer.verl_backend``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from trainer.buckets import BucketBuffer, TensorEntry, WeightBucket, aligned, dtype_name


@dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    value: torch.Tensor
    entry: TensorEntry


def _layout(
    tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None
) -> list[list[_Slot]]:
    """The buckets as ``pack_buckets`` would lay out the whole tensors (global shapes only)."""
    buckets: list[list[_Slot]] = [[]]
    used = 0
    for name, value in tensors:
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        shape = tuple(value.shape)
        nbytes = prod(shape) * target.itemsize
        offset = aligned(used)
        if buckets[-1] and offset + nbytes > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append(_Slot(name, value, TensorEntry(name, dtype_name(target), shape, offset, nbytes)))
        used = offset + nbytes
    return buckets


def _row_sharded(value: torch.Tensor) -> bool:
    return (
        isinstance(value, DTensor)
        and value.device_mesh.ndim == 1
        and len(value.placements) == 1
        and isinstance(value.placements[0], Shard)
        and value.placements[0].dim == 0
        and value.dim() >= 1
    )


def _write(raw: torch.Tensor, slot: _Slot, rank: int, world_size: int) -> None:
    """This rank's part of ``slot``'s tensor into the file's bytes ``raw``."""
    entry, value = slot.entry, slot.value
    target = getattr(torch, entry.dtype)
    if _row_sharded(value):
        assert isinstance(value, DTensor)
        local = value.to_local()
        rows = value.shape[0]
        per_rank = -(-rows // world_size)  # torch.chunk's split, as FSDP2 shards
        start = min(rank * per_rank, rows)
        if local.numel() == 0:
            return
        if local.shape[0] != min(per_rank, rows - start) or tuple(local.shape[1:]) != tuple(value.shape[1:]):
            raise RuntimeError(
                f"{entry.name}: local shard {tuple(local.shape)} is not rows of {tuple(value.shape)}"
            )
        row_bytes = prod(entry.shape[1:]) * target.itemsize
        begin = entry.offset + start * row_bytes
        destination = raw[begin : begin + local.numel() * target.itemsize].view(target).view(local.shape)
        destination.copy_(local.detach())
        return
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    if rank == 0 and whole.numel():
        destination = raw[entry.offset : entry.offset + entry.nbytes].view(target).view(entry.shape)
        destination.copy_(whole.detach())


def sharded_buckets(
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int,
    directory: Path | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[WeightBucket]:
    """Collective: every rank of the default group calls it with the same ``tensors`` (names and
    DTensors, in the same order) and iterates it to the end; rank 0 yields the buckets (each
    valid until it is resumed), the others yield nothing. The file is unlinked at the end."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = _layout(tensors, bucket_bytes, dtype)
    size = max((s.entry.offset + s.entry.nbytes for bucket in layout for s in bucket), default=0)
    buffer = BucketBuffer.create(directory, size) if rank == 0 else None
    shared: list[str | None] = [str(buffer.path) if buffer is not None else None]
    try:
        dist.broadcast_object_list(shared, src=0)
        path = shared[0]
        assert path is not None
        raw = (
            buffer.bytes
            if buffer is not None
            else torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)
        )
        for index, bucket in enumerate(layout):
            for slot in bucket:
                _write(raw, slot, rank, world_size)
            dist.barrier()  # every rank's rows are in
            if rank == 0:
                last = index == len(layout) - 1
                yield WeightBucket(path, tuple(s.entry for s in bucket), index, last)
            dist.barrier()  # the consumer is done with it: the next may overwrite it
    finally:
        if buffer is not None:
            buffer.close()
