"""The weight group (``trainer.weight_group``) with the workers' side that vLLM runs
(``appliance.engines.vllm_worker``'s ``appliance_join_group`` / ``appliance_receive_bucket``),
on real gloo groups in threads of this process.

The consumer stands where ``VLLMEngine`` does: a bucket's receive (``/collective_rpc`` in the
worker's thread) starts only once rank 0 has handed the bucket on, and completes before the
generator resumes. ``nccl-like`` wraps gloo as ``ProcessGroupNCCL`` behaves: a group that is
connected by its first collective, which returns only once every rank has entered one (its
``ncclCommInitRank``). A push that makes that first collective itself never gets going: rank 0
waits inside it for the workers, the workers wait for the bucket rank 0 would hand on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed

from appliance.engines.vllm_process import free_port
from appliance.engines.vllm_worker import ApplianceWorkerExtension
from trainer.buckets import WeightBucket
from trainer.weight_group import GroupSpec, WeightGroup, group_buckets

_dist: Any = torch.distributed
_GLOO = _dist.ProcessGroupGloo
#: Each group's timeout: what a push that deadlocks takes to fail.
TIMEOUT_S = 10.0


class FirstCollectiveWaits:
    """A gloo group that behaves as an NCCL one: its first collective returns only once every
    rank has entered a collective (each rank marks itself in the store, then waits for all
    the marks), then runs the real gloo op."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        self._gloo = _GLOO(store, rank, size, timeout)
        self._store, self._rank, self._size, self._timeout = store, rank, size, timeout
        self.connected = False
        #: How the group was ended: "shutdown", "abort", or None while it is live.
        self.ended: str | None = None

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        if not self.connected:
            self._store.set(f"first-collective/{self._rank}", "1")
            self._store.wait([f"first-collective/{r}" for r in range(self._size)], self._timeout)
            self.connected = True
        return self._gloo.broadcast(tensor, root)

    def shutdown(self) -> None:
        self.ended = "shutdown"
        self._gloo.shutdown()

    def abort(self) -> None:
        self.ended = "abort"
        self._gloo.abort()


class Unconnected:
    """A process group built as ``ProcessGroupNCCL`` is, without connecting (gloo's own
    constructor would wait for the missing member itself): what ends it is recorded."""

    def __init__(self) -> None:
        self.ended: str | None = None

    def shutdown(self) -> None:
        self.ended = "shutdown"

    def abort(self) -> None:
        self.ended = "abort"


class Worker(ApplianceWorkerExtension):
    """A vLLM worker as far as the weight group goes (rank 0 of its server): the tensors of each
    bucket it is given are kept instead of loaded into a model."""

    rank = 0

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}

    def _appliance_load(self, spec: dict[str, Any], tensors: Any) -> dict[str, int]:
        _, views = tensors()
        self.received.update((name, tensor.clone()) for name, tensor in views)
        return {"tensors": len(spec["entries"]), "tied_heads": 0}


@pytest.fixture(params=["gloo", "nccl-like"])
def behaviour(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "nccl-like":
        monkeypatch.setattr(_dist, "ProcessGroupGloo", FirstCollectiveWaits)
    return str(request.param)


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16, generator=generator),
        "layer.weight": torch.randn(16, 16, generator=generator),
        "layer.bias": torch.randn(16, generator=generator),
        "steps": torch.arange(7),
        "head.weight": torch.randn(40, 16, generator=generator),
    }


def form(worker: Worker, prefix: str) -> WeightGroup:
    """Rank 0 hosts, the worker joins, both at once (as ``TrainingService`` forms the group)."""
    spec = GroupSpec("127.0.0.1", free_port(), 2, "gloo", prefix, timeout_s=TIMEOUT_S)
    with ThreadPoolExecutor(1) as join:
        joined = join.submit(worker.appliance_join_group, json.dumps({**spec.as_dict(), "rank_offset": 1}))
        group = WeightGroup(spec)
        assert joined.result(timeout=TIMEOUT_S * 3) == 1
    return group


def push(group: WeightGroup, worker: Worker, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> int:
    """``VLLMEngine._send_buckets`` as far as the group goes: each bucket's receive is asked of
    the worker's thread once rank 0 has handed the bucket on, and answered before the next."""
    buckets: Iterator[WeightBucket] = group_buckets(
        tensors.items(), group=group, bucket_bytes=bucket_bytes, device=torch.device("cpu")
    )
    count = 0
    with ThreadPoolExecutor(1) as rpc:
        for bucket in buckets:
            spec = {
                "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in bucket.entries],
                "nbytes": max(bucket.end, 1),
                "first": count == 0,
                "last": bucket.last,
            }
            rpc.submit(worker.appliance_receive_bucket, json.dumps(spec)).result(timeout=TIMEOUT_S * 3)
            count += 1
    return count


@pytest.mark.timeout(120)
def test_a_push_reaches_the_worker_bit_for_bit(behaviour: str) -> None:
    """With the NCCL-like group this push deadlocked on its first bucket (rank 0's broadcast
    was the group's first collective) and failed after the group's timeout."""
    worker = Worker()
    group = form(worker, f"push-{behaviour}")
    tensors = weights()
    started = time.monotonic()
    assert push(group, worker, tensors, bucket_bytes=1500) > 2
    assert worker.received.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(worker.received[name], tensor), name
    assert time.monotonic() - started < TIMEOUT_S / 2  # nothing waited for a timeout
    # And again over the same group.
    doubled = {name: tensor * 2 for name, tensor in tensors.items()}
    push(group, worker, doubled, bucket_bytes=1 << 20)
    assert all(torch.equal(worker.received[name], tensor) for name, tensor in doubled.items())


@pytest.mark.timeout(120)
def test_the_group_is_connected_when_it_forms(behaviour: str) -> None:
    """Rank 0's side and the worker's have both made their first collective before the join
    returns: nothing of a push is left to connect the group."""
    worker = Worker()
    group = form(worker, f"connected-{behaviour}")
    worker_group = vars(worker)["_appliance_weight_group"][0]
    if behaviour == "nccl-like":
        assert group.group.connected and worker_group.connected


@pytest.mark.timeout(120)
def test_groups_are_ended_when_closed_or_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing rank 0's side, and a worker leaving or joining a new group, end the earlier
    process group themselves (NCCL's destructor would, at exit, with a warning on every rank)."""
    monkeypatch.setattr(_dist, "ProcessGroupGloo", FirstCollectiveWaits)
    worker = Worker()
    first = form(worker, "replaced-1")
    host_side, worker_side = first.group, vars(worker)["_appliance_weight_group"][0]
    first.close()
    assert host_side.ended == "abort" and first.group is None
    first.close()  # idempotent
    second = form(worker, "replaced-2")
    assert worker_side.ended == "abort"
    assert vars(worker)["_appliance_weight_group"][0].ended is None
    tensors = weights()
    push(second, worker, tensors, bucket_bytes=1 << 20)
    assert all(torch.equal(worker.received[name], tensor) for name, tensor in tensors.items())
    last = vars(worker)["_appliance_weight_group"][0]
    second.close()
    assert worker.appliance_leave_group() and last.ended == "abort"
    assert not worker.appliance_leave_group()


@pytest.mark.timeout(120)
def test_a_member_that_never_joins_fails_the_host_within_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Unconnected] = []

    def recorded(*args: Any) -> Unconnected:
        made.append(Unconnected())
        return made[-1]

    monkeypatch.setattr(_dist, "ProcessGroupGloo", recorded)
    spec = GroupSpec("127.0.0.1", free_port(), 2, "gloo", "alone", timeout_s=3.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        WeightGroup(spec)
    assert time.monotonic() - started < 3.0 * 3
    (group,) = made
    assert group.ended == "abort"


def test_nccl_needs_a_cuda_device() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), 2, "nccl", "cpu", timeout_s=3.0)
    with pytest.raises(ValueError, match="CUDA device"):
        WeightGroup(spec, torch.device("cpu"))
