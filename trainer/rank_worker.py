"""The body of one trainer rank: a worker process that runs commands on its verl trainer.

Owns :func:`serve`, the target ``trainer.ranks.RankGroup`` spawns once per rank. It joins the
process group (``init_method``, a file every rank shares), builds its ``VerlFSDPTrainer`` (rank
``r`` of ``n``: FSDP shards parameters, gradients and optimizer state over the ranks), answers
``Ok`` once ready, then runs the commands of ``trainer.rank_rpc`` one at a time until
``Shutdown`` or until the driver's end of the pipe closes. A command that raises answers
``Failed`` with the traceback; the driver then stops every rank (a rank that raised inside a
collective leaves the others waiting in it).
"""

from __future__ import annotations

import logging
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from trainer import rank_rpc as rpc

log = logging.getLogger(__name__)


def serve(
    conn: Connection,
    *,
    rank: int,
    world_size: int,
    init_method: str,
    model_dir: str,
    options: dict[str, Any],
    threads: int | None,
) -> None:
    """Run rank ``rank`` of ``world_size`` until told to stop (the spawned process's target)."""
    if threads is not None:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # A deprecation note torch logs once per process when transformers asks whether it is
    # being traced (every rank would print it to the appliance's terminal).
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    try:
        from trainer.verl_backend import VerlFSDPTrainer

        trainer = VerlFSDPTrainer(
            model_dir, rank=rank, world_size=world_size, init_method=init_method, **options
        )
    except BaseException as exc:
        conn.send(rpc.Failed(type(exc).__name__, str(exc), traceback.format_exc()))
        return
    conn.send(rpc.Ok())
    try:
        while True:
            try:
                command: rpc.Command = conn.recv()
            except EOFError:
                return  # the driver went away
            if isinstance(command, rpc.Shutdown):
                conn.send(rpc.Ok())
                return
            try:
                conn.send(rpc.Ok(_run(trainer, command, conn)))
            except Exception as exc:
                conn.send(rpc.Failed(type(exc).__name__, str(exc), traceback.format_exc()))
    finally:
        try:
            trainer.close()  # the weight group it hosts, if any
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _run(trainer: Any, command: rpc.Command, conn: Connection) -> Any:
    if isinstance(command, rpc.RunStep):
        return trainer.run_step(command.work)
    if isinstance(command, rpc.Save):
        trainer.global_step = command.step
        return trainer.save(command.store, command.version)
    if isinstance(command, rpc.Load):
        version = trainer.load(command.store, command.version)
        return version, trainer.global_step
    if isinstance(command, rpc.Offload):
        return trainer.offload()
    if isinstance(command, rpc.Onload):
        return trainer.onload()
    if isinstance(command, rpc.PushWeights):
        count = 0
        for bucket in trainer.push(command):
            conn.send(rpc.BucketReady(bucket))
            reply = conn.recv()
            if not isinstance(reply, rpc.Continue):
                raise RuntimeError(f"expected Continue during a weight push, got {type(reply).__name__}")
            count += 1
        return count
    if isinstance(command, rpc.HostWeightGroup):
        return trainer.host_weight_group(command.spec)
    if isinstance(command, rpc.StateDict):
        state = trainer.state_dict_for_engine()
        return state if trainer.rank == 0 else None
    raise TypeError(f"unknown trainer rank command {type(command).__name__}")
