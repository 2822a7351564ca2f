"""Trainer ranks: N worker processes (one per GPU; on CPU N processes on gloo) driven as one trainer.

Owns :class:`RankGroup` (spawning the ranks, one command to every rank, one reply from each,
stopping them) and :class:`RankedTrainer`, the :class:`~trainer.items.Trainer` the appliance
drives when ``trainer_ranks`` > 0 with the verl backend. It does not own what a rank does
(``trainer.rank_worker`` on ``trainer.verl_backend.VerlFSDPTrainer``), the messages
(``trainer.rank_rpc``) nor how a step is split (``trainer.step_plan``).

Why processes and pipes: torch.distributed needs one process per rank, and
``multiprocessing``'s spawn context with a pipe per rank is all the driving needed on one machine
(no Ray: nothing spans machines here). The ranks meet through a file (``FileStore``), so no port
is opened.

Nothing hangs: every wait for a reply polls the pipe and checks that every rank is alive. A rank
that died, raised, or stopped answering (within ``reply_timeout_s`` where it is set; during a
push over the weight group, within the group's timeout plus a margin) fails the call with
:class:`~trainer.rank_rpc.TrainerRankFailed` and every rank is stopped (a rank that raised
inside a collective leaves the others waiting in it; they are killed, not waited for). The
group must then be restarted (:meth:`RankedTrainer.restart`), and the caller loads the last
published version into it (``appliance.training.service.TrainingService``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpoints import CheckpointError, CheckpointStore
from trainer.items import StepOutput, TrainItem
from trainer.options import VerlOptions
from trainer.push_api import PushApi
from trainer.rank_rpc import (
    BucketReady,
    Command,
    Continue,
    Failed,
    HostWeightGroup,
    Load,
    Offload,
    Ok,
    Onload,
    PushWeights,
    RunStep,
    Save,
    Shutdown,
    StateDict,
    TrainerRankFailed,
)
from trainer.rank_worker import serve
from trainer.sharded import ShardedStore
from trainer.step_plan import RankResult, finish, plan_step, shard
from trainer.weight_group import GroupSpec

if TYPE_CHECKING:
    from trainer.buckets import WeightBucket

log = logging.getLogger(__name__)

#: Seconds between liveness checks while waiting for a rank.
_POLL_S = 0.05
#: Seconds a rank may take for a bucket of a push over the weight group beyond the group's
#: ``timeout_s`` (which bounds its wait for the previous broadcast): gathering and packing.
GROUP_PUSH_MARGIN_S = 120.0


def rank_options(options: dict[str, Any], gpus: Sequence[int] | None, rank: int) -> dict[str, Any]:
    """The trainer options of rank ``rank``: on the GPU the placement gave it, if it gave any
    (``device`` ``cuda:<gpu>``), else as given (verl's runtime puts rank r on GPU r)."""
    if gpus is None:
        return dict(options)
    return {**options, "device": f"cuda:{gpus[rank]}"}


class RankGroup:
    """``world_size`` trainer processes; :meth:`call` sends one command to each."""

    def __init__(
        self,
        model_dir: str | Path,
        world_size: int,
        options: dict[str, Any],
        *,
        threads: int | None = None,
        gpus: Sequence[int] | None = None,
        start_timeout_s: float = 900.0,
        reply_timeout_s: float | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"a trainer needs at least one rank, got {world_size}")
        if gpus is not None and (len(gpus) != world_size or len(set(gpus)) != world_size):
            raise ValueError(f"{world_size} trainer ranks need {world_size} distinct GPUs, got {list(gpus)}")
        #: The GPU of each rank (the placement's training GPUs), None: rank r on GPU r.
        self.gpus = tuple(gpus) if gpus is not None else None
        self.model_dir = str(model_dir)
        self.world_size = world_size
        self.options = dict(options)
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self._processes: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._rendezvous: tempfile.TemporaryDirectory[str] | None = None
        #: Bucket files of a push under way (unlinked if the rank that writes them dies).
        self._bucket_paths: set[str] = set()

    @property
    def running(self) -> bool:
        return bool(self._processes)

    def pids(self) -> list[int]:
        """Process ids of the ranks, rank order (empty when stopped)."""
        return [p.pid for p in self._processes if p.pid is not None]

    def start(self) -> None:
        """Spawn the ranks and wait until each has built its trainer."""
        if self._processes:
            raise RuntimeError("the trainer ranks are already running")
        ctx = multiprocessing.get_context("spawn")
        self._rendezvous = tempfile.TemporaryDirectory(prefix="appliance-ranks-")
        init_method = f"file://{Path(self._rendezvous.name) / 'rendezvous'}"
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=serve,
                args=(child,),
                kwargs={
                    "rank": rank,
                    "world_size": self.world_size,
                    "init_method": init_method,
                    "model_dir": self.model_dir,
                    "options": rank_options(self.options, self.gpus, rank),
                    "threads": self.threads,
                },
                name=f"trainer-rank-{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)
        self._gather(timeout_s=self.start_timeout_s, what="starting")

    def call(self, commands: Sequence[Command], *, timeout_s: float | None = None) -> list[Any]:
        """Send ``commands[r]`` to rank ``r`` and return every rank's value (rank order)."""
        if len(commands) != self.world_size:
            raise ValueError(f"{len(commands)} commands for {self.world_size} ranks")
        self._ensure_running()
        for rank, command in enumerate(commands):
            self._send(rank, command)
        return self._gather(timeout_s=timeout_s, what=type(commands[0]).__name__)

    def broadcast(self, command: Command, *, timeout_s: float | None = None) -> list[Any]:
        """The same command to every rank."""
        return self.call([command] * self.world_size, timeout_s=timeout_s)

    def push(self, command: PushWeights, *, timeout_s: float | None = None) -> Iterator[WeightBucket]:
        """Run a weight push: yields rank 0's buckets one at a time; each must be consumed
        before the next is asked for. Closing the generator early stops the ranks.
        ``timeout_s``: how long each rank may take to answer (its next bucket, its reply)
        once the previous bucket was consumed; None: ``reply_timeout_s``."""
        self._ensure_running()
        for rank in range(self.world_size):
            self._send(rank, command)
        what = "PushWeights over the weight group" if command.via_group else "PushWeights"
        done = False
        try:
            while True:
                message = self._receive(0, timeout_s=timeout_s, what=what)
                if not isinstance(message, BucketReady):
                    self._finish_push(message, timeout_s, what)
                    done = True
                    return
                self._bucket_paths.add(message.bucket.path)
                try:
                    yield message.bucket
                except GeneratorExit:
                    if message.bucket.last:  # the consumer stopped after the last bucket: fine
                        self._send(0, Continue())
                        self._finish_push(self._receive(0, timeout_s=timeout_s, what=what), timeout_s, what)
                        done = True
                    raise
                self._send(0, Continue())
        finally:
            if not done:
                self.kill()  # a push abandoned half-way leaves ranks inside collectives
            self._bucket_paths.clear()

    def _finish_push(self, reply: Any, timeout_s: float | None, what: str) -> None:
        """Rank 0's reply to a push, then every other rank's."""
        self._check(0, reply)
        for rank in range(1, self.world_size):
            self._check(rank, self._receive(rank, timeout_s=timeout_s, what=what))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to exit, then kill what is still there after ``timeout_s``."""
        if not self._processes:
            return
        for rank in range(self.world_size):
            with contextlib.suppress(OSError, ValueError):
                self._conns[rank].send(Shutdown())
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Stop every rank now (SIGKILL) and forget them; idempotent."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(5.0)
        for conn in self._conns:
            conn.close()
        for path in self._bucket_paths:
            Path(path).unlink(missing_ok=True)
        self._bucket_paths.clear()
        self._processes, self._conns = [], []
        if self._rendezvous is not None:
            self._rendezvous.cleanup()
            self._rendezvous = None

    # --- plumbing ----------------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if not self._processes:
            raise TrainerRankFailed("the trainer ranks are not running (a rank failed): restart them")

    def _send(self, rank: int, command: Command | Continue) -> None:
        try:
            self._conns[rank].send(command)
        except (OSError, ValueError) as exc:
            reason = self._dead() or f"its pipe failed: {exc}"
            self.kill()
            raise TrainerRankFailed(f"trainer rank {rank} cannot take commands: {reason}") from exc

    def _gather(self, *, timeout_s: float | None, what: str) -> list[Any]:
        replies = [self._receive(rank, timeout_s=timeout_s, what=what) for rank in range(self.world_size)]
        return [self._check(rank, reply) for rank, reply in enumerate(replies)]

    def _receive(self, rank: int, *, timeout_s: float | None, what: str) -> Any:
        """The next message from ``rank``; every rank must stay alive meanwhile."""
        limit = timeout_s if timeout_s is not None else self.reply_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        conn = self._conns[rank]
        while True:
            try:
                if conn.poll(_POLL_S):
                    return conn.recv()
            except (EOFError, OSError):
                pass  # the rank's end closed: it died; say which one below
            dead = self._dead()
            if dead is not None:
                self.kill()
                raise TrainerRankFailed(f"{dead} while {what}")
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise TrainerRankFailed(f"trainer rank {rank} did not answer {what} within {limit:.0f} s")

    def _dead(self) -> str | None:
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                return f"trainer rank {rank} died (exit code {process.exitcode})"
        return None

    def _check(self, rank: int, reply: Any) -> Any:
        if isinstance(reply, Ok):
            return reply.value
        self.kill()
        if isinstance(reply, Failed):
            log.error("trainer rank %d failed:\n%s", rank, reply.traceback)
            if reply.kind == "CheckpointError":
                raise CheckpointError(reply.message)
            raise TrainerRankFailed(f"trainer rank {rank} raised {reply.kind}: {reply.message}")
        raise TrainerRankFailed(f"trainer rank {rank} answered {type(reply).__name__}, not a reply")


class RankedTrainer(PushApi):
    """The verl trainer over ``ranks`` worker processes, with the ``Trainer`` API.

    ``options`` are ``VerlFSDPTrainer``'s keyword arguments (each rank builds one with them).
    The step is planned here (``trainer.step_plan``), run by every rank on its share, and the
    ranks' results are combined into one ``StepOutput``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        ranks: int,
        threads: int | None = None,
        gpus: Sequence[int] | None = None,
        reply_timeout_s: float | None = None,
        **options: Any,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.ranks = ranks
        self.global_step = 0
        #: What every rank builds its trainer with (checked here before any rank starts).
        self.options = VerlOptions(**options)
        self.group = RankGroup(
            model_dir, ranks, options, threads=threads, gpus=gpus, reply_timeout_s=reply_timeout_s
        )
        #: The timeout of the weight group rank 0 hosts (``host_weight_group``), if any.
        self._group_timeout_s: float | None = None
        #: Whether the ranks were last told to offload: fresh ranks (``restart``) offload too, so
        #: a collocated engine that wakes next finds the GPU as the plan left it.
        self._offloaded = False
        self.group.start()

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.group.running

    def restart(self) -> None:
        """Stop whatever is left of the ranks and start fresh ones (weights from ``model_dir``:
        load a version next), offloaded if the ranks they replace were."""
        self.group.kill()
        self.group.start()
        if self._offloaded:
            self.group.broadcast(Offload())

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        self.group.stop()

    # --- the Trainer API -------------------------------------------------------------------------

    def step(self, items: Sequence[TrainItem]) -> StepOutput:
        start = time.perf_counter()
        plan = plan_step(items, self.options, self.options.mini_batches)
        commands = [RunStep(shard(plan, rank, self.ranks)) for rank in range(self.ranks)]
        results: list[RankResult] = self.group.call(commands)
        output = finish(plan, results, time.perf_counter() - start)
        self.global_step = output.step
        return output

    def save(self, store: CheckpointStore | ShardedStore, version: int) -> Path:
        paths = self.group.broadcast(Save(store, version, self.global_step))
        return Path(paths[0])

    def load(self, store: CheckpointStore | ShardedStore, version: int | None = None) -> int:
        replies = self.group.broadcast(Load(store, version))
        loaded, step = replies[0]
        self.global_step = int(step)
        return int(loaded)

    def offload(self) -> None:
        """Every rank offloads (``VerlFSDPTrainer.offload``: its GPU's cache emptied last)."""
        self.group.broadcast(Offload())
        self._offloaded = True

    def onload(self) -> None:
        self.group.broadcast(Onload())
        self._offloaded = False

    def push(self, request: PushWeights) -> Iterator[WeightBucket]:
        """``weight_buckets`` (:class:`~trainer.push_api.PushApi`): the buckets written by the
        ranks and handed on by rank 0 (``VerlFSDPTrainer.push``); over the weight group
        (:meth:`host_weight_group`) each bucket is waited for at most the group's timeout plus
        ``GROUP_PUSH_MARGIN_S`` (then ``TrainerRankFailed``)."""
        timeout_s = None
        if request.via_group and self._group_timeout_s is not None:
            timeout_s = self._group_timeout_s + GROUP_PUSH_MARGIN_S
        yield from self.group.push(request, timeout_s=timeout_s)

    def host_weight_group(self, spec: GroupSpec) -> None:
        """Rank 0 hosts the weight group ``spec`` and joins it; returns once every member has
        joined and the group is connected (the engine's workers join at the same time:
        ``join_weight_group``)."""
        self._group_timeout_s = None
        self.group.broadcast(HostWeightGroup(spec), timeout_s=spec.timeout_s + 30)
        self._group_timeout_s = spec.timeout_s

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self.group.broadcast(StateDict())[0]
        return state
