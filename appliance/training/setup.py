"""Building a run's trainer and training service from its config and placement plan.

Owns :func:`start_training`: which backend and how many ranks (the plan's training GPUs on GPUs,
the config's ``trainer_ranks`` otherwise), the checkpoint stores (sharded for verl's ranks, one
file per version for the torch backend) and the dtypes the weights are kept and pushed in; and
:func:`restore_training`, the start's restore at the log's version, handing a collocated GPU
from the trainer to the engine. It does not own the trainers (``trainer``), the service that
drives them (``appliance.training.service``) nor when they start (the composition root,
``appliance.app``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from appliance.training.service import TrainingService
from store.eventstore import EventStore
from trainer.checkpoints import CheckpointStore
from trainer.factory import make_trainer
from trainer.sharded import ShardedStore

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig
    from appliance.engines.base import Engine
    from appliance.placement.decision import Plan
    from store.projections import RunState


async def start_training(
    config: ApplianceConfig, model_dir: Path, plan: Plan | None, *, store: EventStore, engine: Engine
) -> tuple[TrainingService, int]:
    """The trainer the run asks for, built at the model's own weights (in a worker thread), and
    the training service over it; with the number of trainer ranks (1: the torch backend)."""
    on_gpus = plan is not None and plan.device == "cuda"
    train = config.trainer
    verl = train.backend == "verl"
    trainer_ranks = config.resolved_trainer_ranks()
    trainer_gpus = None
    if on_gpus and plan is not None and verl:
        # The plan's training GPUs (in split placement, those the engine does not use).
        trainer_ranks, trainer_gpus = plan.trainer_ranks, plan.trainer_gpus
    trainer = await asyncio.to_thread(
        make_trainer,
        "verl" if verl else "torch",
        model_dir,
        # verl trains in worker processes (one per GPU, or processes on gloo on CPU).
        ranks=trainer_ranks if verl else None,
        threads=config.threads,
        gpus=trainer_gpus,
        **train.options(device=config.device, temperature=config.proxy.temperature),
    )
    # verl's ranks write sharded checkpoints in parallel (and bf16 per-version weights when
    # they compute in bf16); the torch backend one file per version.
    checkpoints: CheckpointStore | ShardedStore = (
        ShardedStore(config.checkpoint_dir, keep=train.keep_checkpoints)
        if verl
        else CheckpointStore(config.checkpoint_dir, keep=train.keep_checkpoints)
    )
    # The one dtype the trainer computes in and vLLM serves in (``config.engine_dtype``).
    dtype = getattr(torch, config.engine_dtype())
    training = TrainingService(
        trainer=trainer,
        checkpoints=checkpoints,
        store=store,
        engine=engine,
        advantage=train.advantage,
        checkpoint_every=train.checkpoint_every,
        push_bucket_bytes=train.push_bucket_mb << 20,
        keep_versions=train.keep_versions,
        weights_dtype=torch.bfloat16 if verl and dtype == torch.bfloat16 else None,
        # A trainer computing in 16 bits hands the engine weights in that dtype, the one it
        # serves in (half the bytes of fp32).
        push_dtype=dtype if verl and dtype != torch.float32 else None,
        weight_group=config.weight_group_backend(),
    )
    return training, trainer_ranks if verl else 1


async def restore_training(
    training: TrainingService, engine: Engine, state: RunState, *, collocated: bool
) -> None:
    """The trainer and the engine at the log's policy version (at version 0 both already are).
    ``collocated``: the engine sleeps until the trainer has been restored and offloaded, then
    wakes (before the restored version is pushed to it), as after every step."""

    async def hand_over() -> None:
        """The GPU from the trainer to the engine, as after every step."""
        await training.offload()
        await engine.wake()

    if state.policy_version > 0:
        await training.restore(state, before_push=hand_over if collocated else None)
    elif collocated:
        await hand_over()
