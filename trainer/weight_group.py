"""A weight push broadcast over a process group: from the trainer's rank 0 to every vLLM worker.

Owns :class:`GroupSpec` (where and how the group meets), :class:`WeightGroup` (rank 0's side:
it hosts the rendezvous store, is rank 0 of the group and connects it) and
:func:`group_buckets` (a push's tensors packed into one reusable buffer on rank 0's device and
broadcast, a bucket at a time, in ``trainer.buckets``' layout). The workers' side is
``appliance.engines.vllm_worker``'s ``appliance_join_group`` / ``appliance_receive_bucket``
(which repeats the join's few steps: it imports nothing from here); who joins when is
``appliance.training.service``'s.

Why: with the split placement the trainer's GPUs are not vLLM's, and a bucket written to
``/dev/shm`` crosses the host twice (device -> shared memory -> device). Over NCCL it goes GPU
to GPU. NCCL cannot put two ranks of one communicator on one GPU, so collocated runs keep the
shared-memory buckets. On CPU the same code runs on gloo, which is how it is tested.

The group is connected when it forms, never by a push. ``ProcessGroupNCCL`` builds its
communicator at its first collective (torch's lazy init; ``ncclCommInitRank`` returns once
every rank has called it), while gloo connects at construction. A push cannot make that first
collective: a worker enters its broadcast only once ``/collective_rpc`` has delivered the
bucket, which happens after rank 0's broadcast call has returned, so rank 0 would wait for the
workers and the workers for rank 0. So every member, as it joins (rank 0 here, the workers in
``appliance_join_group``, both at once), marks itself in the store, waits for every other
member's mark (bounded by ``timeout_s``: a member that never comes fails the join instead of
leaving rank 0 inside NCCL's init) and then takes part in one small broadcast on the device the
buckets use (rank 0: the trainer's; a worker: its current CUDA device), which also checks the
world size. After that a push's ``broadcast`` only enqueues (NCCL: on its stream; gloo: on
its worker thread) and returns. Read from torch's and NCCL's source; modelled on CPU by a gloo
group whose first collective waits for every rank (``tests/trainer/test_weight_group.py``); run
on one H200 by the GPU check's probe (two ranks on one GPU, NCCL taking them for two hosts), not
yet between two GPUs. Closing (or a worker's leaving or re-joining) ends the process group there
and then: NCCL's destructor would do so at exit, with a warning on every rank.

Invariants: rank 0 broadcasts exactly ``max(end, 1)`` bytes per bucket (``end``: the last
entry's end), which is what every worker allocates from the entries; a bucket's buffer is not
overwritten before its broadcast has completed and the consumer has resumed the generator; no
broadcast of a push needs the consumer to finish with its bucket before the call returns; every
wait is bounded by ``timeout_s`` (a ``Work.wait`` given a timeout blocks the CPU until the
collective completes, on NCCL as on gloo).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed

from trainer.buckets import TensorEntry, WeightBucket, lay_out

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


#: The store key a member sets once its process group is built (``{rank}`` filled in); the
#: workers' side (``appliance.engines.vllm_worker``) uses the same.
JOINED_KEY = "appliance-weight-group-joined/{rank}"


class WeightGroup:
    """Rank 0's membership: hosts the store, joins as rank 0 and connects the group on
    ``device``, where its broadcasts' buffers are (see the module docstring). Constructing it
    returns once every member has joined and the first broadcast has gone through, and raises
    if a member does not come (each wait bounded by ``timeout_s``)."""

    def __init__(self, spec: GroupSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        if spec.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"an NCCL weight group broadcasts from a CUDA device, not {self.device}")
        timeout = timedelta(seconds=spec.timeout_s)
        self._store = _dist.TCPStore(
            spec.host, spec.port, spec.world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        prefixed = _dist.PrefixStore(spec.prefix, self._store)
        if spec.backend == "nccl":
            options = _dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: Any = _dist.ProcessGroupNCCL(prefixed, 0, spec.world_size, options)
        else:
            self.group = _dist.ProcessGroupGloo(prefixed, 0, spec.world_size, timeout)
        try:
            self._connect(prefixed, timeout)
        except BaseException:
            self.close()
            raise

    def _connect(self, store: Any, timeout: timedelta) -> None:
        """Wait for every member's mark, then make the group's first collective: a broadcast of
        the world size, which every worker checks."""
        store.set(JOINED_KEY.format(rank=0), "1")
        store.wait([JOINED_KEY.format(rank=r) for r in range(self.spec.world_size)], timeout)
        probe = torch.tensor([self.spec.world_size], dtype=torch.int64, device=self.device)
        self.group.broadcast(probe, 0).wait(timeout)

    def broadcast(self, data: torch.Tensor) -> Any:
        """Start sending ``data`` (on :attr:`device`) to every member (a ``Work`` to wait on)."""
        return self.group.broadcast(data, 0)

    def close(self) -> None:
        """End the process group (NCCL: its communicator destroyed) and release the store.
        Idempotent. An abort, not a shutdown: a shutdown first flushes what is pending, which a
        group that failed (a member gone mid-broadcast) may never finish, and a group that worked
        has nothing pending (a push waits for each broadcast). Either way the group's destructor
        is not left to do it at exit, where NCCL warns on every rank."""
        group, self.group = self.group, None
        self._store = None
        if group is not None:
            group.abort()


def group_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    group: WeightGroup,
    bucket_bytes: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> Iterator[WeightBucket]:
    """``trainer.buckets.pack_buckets``' buckets (the same layout, ``path`` empty and
    ``via_group`` set), each broadcast from a buffer on ``device`` while it is handed on: the
    broadcast is started (the group is connected: the call returns at once), the bucket yielded
    (the consumer has the workers receive it), and once the consumer resumes the generator the
    broadcast is waited for, at most ``timeout_s``, before the buffer is reused. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    timeout = timedelta(seconds=group.spec.timeout_s)
    entries: list[TensorEntry] = []
    index = 0

    def send(last: bool) -> Iterator[WeightBucket]:
        bucket = WeightBucket("", tuple(entries), index, last, via_group=True)
        work = group.broadcast(buffer[: max(bucket.end, 1)])
        yield bucket
        work.wait(timeout)

    for source, target, entry, new_bucket in lay_out(tensors, bucket_bytes=bucket_bytes, dtype=dtype):
        if new_bucket:
            yield from send(last=False)
            entries, index = [], index + 1
        end = entry.offset + entry.nbytes
        if end > buffer.numel():
            buffer = torch.empty(end, dtype=torch.uint8, device=device)
        destination = buffer[entry.offset : end].view(target).view(source.shape)
        destination.copy_(source)
        entries.append(entry)
    yield from send(last=True)
