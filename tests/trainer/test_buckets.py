"""Weight buckets: what goes into the bucket file comes out bit for bit, one file serves a whole
push, and the file never outlives its producer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.buckets import (
    ALIGN,
    BucketBuffer,
    WeightBucket,
    bucket_tensors,
    default_directory,
    pack_buckets,
    stream_buckets,
)


def sample_tensors() -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and shapes, a scalar, an empty one and a non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(50, 16, generator=g)),
        ("norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("proj.weight", torch.randn(24, 16, generator=g).T),  # a transposed view
        ("scale", torch.tensor(3.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
        ("counts", torch.arange(13, dtype=torch.int64)),
        ("mask", torch.rand(9, generator=g) > 0.5),
        ("half.weight", torch.randn(7, 3, generator=g).half()),
    ]


def unpack(buckets: Iterator[WeightBucket]) -> tuple[list[WeightBucket], dict[str, torch.Tensor]]:
    """Every bucket, and clones of its tensors taken while it is valid."""
    seen: list[WeightBucket] = []
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        seen.append(bucket)
        for name, tensor in bucket_tensors(bucket):
            assert name not in out
            out[name] = tensor.clone()
    return seen, out


def assert_bit_identical(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    if expected.is_floating_point() and expected.numel():  # the bits, -0.0 and NaN included
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.itemsize]
        assert torch.equal(got.contiguous().view(bits), expected.contiguous().view(bits))


@pytest.mark.parametrize("bucket_bytes", [1, 100, 700, 4096, 1 << 20])
def test_round_trip_is_bit_identical_through_one_reused_file(tmp_path: Path, bucket_bytes: int) -> None:
    tensors = sample_tensors()
    buckets, out = unpack(pack_buckets(tensors, bucket_bytes=bucket_bytes, directory=tmp_path))
    assert list(out) == [name for name, _ in tensors]
    for name, tensor in tensors:
        assert_bit_identical(out[name], tensor)
    # One file for the whole push, gone once the producer is done.
    assert len({b.path for b in buckets}) == 1
    assert not Path(buckets[0].path).exists() and not list(tmp_path.iterdir())
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    for bucket in buckets:
        assert all(e.offset % ALIGN == 0 for e in bucket.entries)
        end = max(e.offset + e.nbytes for e in bucket.entries)
        # Full buckets: only a tensor bigger than a bucket makes one bigger, and then alone.
        assert end <= bucket_bytes or len(bucket.entries) == 1
    if bucket_bytes == 1:
        assert len(buckets) == len(tensors)
    if bucket_bytes == 1 << 20:
        assert len(buckets) == 1


def test_the_file_is_reused_and_grows_only_for_a_big_tensor(tmp_path: Path) -> None:
    tensors = [(f"w{i}", torch.full((100,), float(i))) for i in range(6)]  # 400 bytes each
    tensors.insert(3, ("big", torch.ones(1000)))  # 4000 bytes: more than a bucket
    sizes, paths = [], set()
    for bucket in pack_buckets(tensors, bucket_bytes=1024, directory=tmp_path):
        paths.add(bucket.path)
        sizes.append(Path(bucket.path).stat().st_size)
        assert list(tmp_path.iterdir()) == [Path(bucket.path)]
    assert len(paths) == 1
    assert sizes[0] == 1024 and max(sizes) == 4000  # grown once, for "big", never shrunk or copied


def test_cast_to_dtype_casts_floats_only(tmp_path: Path) -> None:
    tensors = sample_tensors()
    _, out = unpack(pack_buckets(tensors, bucket_bytes=256, directory=tmp_path, dtype=torch.bfloat16))
    for name, tensor in tensors:
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert_bit_identical(out[name], expected)


def test_the_file_is_unlinked_when_the_producer_is_closed_early(tmp_path: Path) -> None:
    buckets = pack_buckets(sample_tensors(), bucket_bytes=64, directory=tmp_path)
    first = next(buckets)
    assert Path(first.path).exists() and not first.last
    view = dict(bucket_tensors(first))["embed.weight"]
    buckets.close()
    assert not Path(first.path).exists()
    assert view.shape == (50, 16)  # a view still held keeps its pages mapped (no crash reading it)
    float(view.sum())


def test_the_file_is_unlinked_when_the_source_fails(tmp_path: Path) -> None:
    def failing() -> Iterator[tuple[str, torch.Tensor]]:
        yield "a", torch.ones(100)
        yield "b", torch.ones(100)
        raise RuntimeError("the trainer failed")

    with pytest.raises(RuntimeError, match="trainer failed"):
        unpack(pack_buckets(failing(), bucket_bytes=400, directory=tmp_path))
    assert not list(tmp_path.iterdir())


def test_no_tensors_is_one_empty_last_bucket(tmp_path: Path) -> None:
    buckets, out = unpack(pack_buckets([], bucket_bytes=10, directory=tmp_path))
    assert [(b.index, b.entries, b.last) for b in buckets] == [(0, (), True)]
    assert out == {}


def test_bad_bucket_size_and_default_directory() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(pack_buckets([("a", torch.ones(1))], bucket_bytes=0))
    if Path("/dev/shm").is_dir():
        assert default_directory() == Path("/dev/shm")
    bucket = next(pack_buckets([("a", torch.ones(1))], bucket_bytes=8))
    assert Path(bucket.path).parent == default_directory()


def test_buffer_close_is_idempotent(tmp_path: Path) -> None:
    with BucketBuffer.create(tmp_path, 10) as buffer:
        buffer.bytes[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
        assert Path(buffer.path).read_bytes()[:3] == b"\x01\x02\x03"  # written to the file itself
        buffer.grow(5000)
        assert Path(buffer.path).read_bytes()[:3] == b"\x01\x02\x03" and buffer.size == 5000
    buffer.close()
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="closed"):
        buffer.bytes  # noqa: B018


def leftovers(directory: Path) -> list[Path]:
    return list(directory.iterdir())


async def test_stream_buckets_closes_the_producer(tmp_path: Path) -> None:
    tensors = sample_tensors()
    got: dict[str, torch.Tensor] = {}
    async for bucket in stream_buckets(pack_buckets(tensors, bucket_bytes=200, directory=tmp_path)):
        got.update((name, t.clone()) for name, t in bucket_tensors(bucket))
    assert all(torch.equal(got[name], t) for name, t in tensors)
    assert not leftovers(tmp_path)

    # Left early (aclose), or cancelled while the producer copies in its thread.
    stream = stream_buckets(pack_buckets(tensors, bucket_bytes=200, directory=tmp_path))
    await anext(stream)
    await stream.aclose()
    assert not leftovers(tmp_path)

    def slow() -> Iterator[tuple[str, torch.Tensor]]:
        yield "a", torch.ones(100)
        import time

        time.sleep(0.3)
        yield "b", torch.ones(100)

    stream = stream_buckets(pack_buckets(slow(), bucket_bytes=8, directory=tmp_path))
    task = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert not leftovers(tmp_path)
