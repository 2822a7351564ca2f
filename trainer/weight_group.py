"""A weight push broadcast over a process group: from the trainer's rank 0 to every vLLM worker.

Owns :class:`GroupSpec` (where and how the group meets), :class:`WeightGroup` (rank 0's side:
it hosts the rendezvous store and is rank 0 of the group) and :func:`group_buckets` (a push's
tensors packed into one reusable buffer on rank 0's device and broadcast, a bucket at a time,
in ``appliance.engines.buckets``' layout). The workers' side is
``appliance.engines.vllm_worker``'s ``appliance_join_group`` / ``appliance_receive_bucket``; who
joins when is ``appliance.training``'s.

Why: with the split placement the trainer's GPUs are not vLLM's, and a bucket written to
``/dev/shm`` crosses the host twice (device -> shared memory -> device). Over NCCL it goes GPU
to GPU. NCCL cannot put two ranks of one communicator on one GPU, so collocated runs keep the
shared-memory buckets. On CPU the same code runs on gloo, which is how it is tested.

Invariants: rank 0 broadcasts exactly ``max(end, 1)`` bytes per bucket (``end``: the last
entry's end), which is what every worker allocates from the entries; a bucket's buffer is not
overwritten before its broadcast has completed and the consumer has resumed the generator; a
broadcast nobody receives fails after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed

from appliance.engines.buckets import TensorEntry, WeightBucket, aligned, dtype_name

#: ``torch.distributed``'s store and process-group classes (not in its type stubs' exports).
_dist: Any = torch.distributed


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where the weight group meets: a TCP store on ``host:port`` that rank 0 (the trainer)
    hosts; ``world_size`` = 1 + every vLLM worker; ``prefix`` keeps one formation's keys apart
    from an earlier one's."""

    host: str
    port: int
    world_size: int
    #: "nccl" (GPUs) or "gloo" (CPU).
    backend: str
    prefix: str
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.world_size < 2 or self.backend not in ("gloo", "nccl") or self.timeout_s <= 0:
            raise ValueError(
                f"a weight group needs world_size >= 2, backend gloo or nccl, timeout > 0: {self}"
            )

    def as_dict(self) -> dict[str, Any]:
        """What an engine's ``join_weight_group`` takes."""
        return asdict(self)


class WeightGroup:
    """Rank 0's membership: hosts the store, joins as rank 0. Constructing it blocks until every
    member has joined (gloo connects them all at once; NCCL on the first broadcast)."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        timeout = timedelta(seconds=spec.timeout_s)
        self._store = _dist.TCPStore(
            spec.host, spec.port, spec.world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        prefixed = _dist.PrefixStore(spec.prefix, self._store)
        if spec.backend == "nccl":
            self.group: Any = _dist.ProcessGroupNCCL(
                prefixed, 0, spec.world_size, _dist.ProcessGroupNCCL.Options()
            )
        else:
            self.group = _dist.ProcessGroupGloo(prefixed, 0, spec.world_size, timeout)

    def broadcast(self, data: torch.Tensor) -> Any:
        """Start sending ``data`` to every member (a ``Work`` to wait on)."""
        return self.group.broadcast(data, 0)

    def close(self) -> None:
        self.group = None
        self._store = None


def group_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    group: WeightGroup,
    bucket_bytes: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> Iterator[WeightBucket]:
    """``appliance.engines.buckets.pack_buckets``' buckets (the same layout, ``path`` empty and
    ``via_group`` set), each broadcast from a buffer on ``device`` while it is handed on; the
    generator resumes only once the consumer is done, and then waits for the broadcast before
    the buffer is reused. A tensor larger than ``bucket_bytes`` gets a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    timeout = timedelta(seconds=group.spec.timeout_s)
    entries: list[TensorEntry] = []
    used = index = 0

    def send(last: bool) -> Iterator[WeightBucket]:
        work = group.broadcast(buffer[: max(used, 1)])
        yield WeightBucket("", tuple(entries), index, last, via_group=True)
        work.wait(timeout)

    for name, tensor in tensors:
        source = tensor.detach()
        target = dtype if dtype is not None and source.is_floating_point() else source.dtype
        nbytes = source.numel() * target.itemsize
        offset = aligned(used)
        if entries and offset + nbytes > bucket_bytes:
            yield from send(last=False)
            entries, used, index, offset = [], 0, index + 1, 0
        if offset + nbytes > buffer.numel():
            buffer = torch.empty(offset + nbytes, dtype=torch.uint8, device=device)
        destination = buffer[offset : offset + nbytes].view(target).view(source.shape)
        destination.copy_(source)
        entries.append(TensorEntry(name, dtype_name(target), tuple(source.shape), offset, nbytes))
        used = offset + nbytes
    yield from send(last=True)
