"""A launch harness for the sharded-checkpoint tests: N real ranks on gloo, FSDP2, a tiny Qwen2.

:func:`launch` starts ``world_size`` fresh processes (multiprocessing "forkserver": no state of
the test process, such as its own process group, is inherited; a ``FileStore`` in the test's
directory, no port), each running one of the scenario functions below. Scenarios talk to
the test through files: rank 0 writes :func:`snapshot` s (the full model and optimizer state,
gathered) that the test compares with ``torch.equal``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer.checkpoints import CheckpointError
from trainer.sharded import ShardedStore, ShardedWeightsStore
from trainer.sharded_format import load_sharded

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def launch(world_size: int, workdir: Path, scenario: Callable[..., None], *args: Any) -> None:
    """Run ``scenario(*args)`` on ``world_size`` ranks; raises if any rank fails."""
    init = workdir / f"pg-{uuid.uuid4().hex}"  # a FileStore must not be reused
    # (``torch.multiprocessing.spawn`` names both a module and a function; the module's.)
    start_processes: Any = importlib.import_module("torch.multiprocessing.spawn").start_processes
    # Ranks fork from a forkserver that has imported torch and transformers once per test run
    # (a spawned rank would spend ~4 s of CPU importing them again).
    multiprocessing.set_forkserver_preload([__name__, "transformers.models.qwen2.modeling_qwen2"])
    start_processes(
        _rank_main, args=(world_size, str(init), scenario, args), nprocs=world_size, start_method="forkserver"
    )


def _rank_main(rank: int, world_size: int, init: str, scenario: Callable[..., None], args: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world_size, timeout=timedelta(seconds=90)
    )
    try:
        scenario(*args)
    finally:
        dist.destroy_process_group()


# --- the model --------------------------------------------------------------------------------------


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 2-layer, 64-wide Qwen2 (tied embeddings), ``fully_shard`` per decoder layer and at the
    root as verl's ``apply_fsdp2`` does, and AdamW over its DTensor parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        vocab_size=300,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model_class: Any = Qwen2ForCausalLM
    model: Any = model_class(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *, first: int = 0) -> None:
    """``steps`` AdamW steps on random tokens (different per rank and step)."""
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(0, 300, (2, 12), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, **extra: Any) -> None:
    """Gather the full model and optimizer state (collective) and save it on rank 0."""
    state = {
        "model": get_model_state_dict(model, options=_FULL),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=_FULL),
        **extra,
    }
    if dist.get_rank() == 0:
        torch.save(state, path)


# --- scenarios (every rank runs them) -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Save:
    """After ``after_steps`` training steps in all, save version ``after_steps`` at ``path``
    (named as a store names it: full with the optimizer, or weights in ``dtype``) and snapshot
    the state to ``expected``."""

    after_steps: int
    path: str
    expected: str
    full: bool
    dtype: str | None = None


def train_and_save(plan: list[Save]) -> None:
    model, optimizer = build(seed=0)
    done = 0
    for item in plan:
        train(model, optimizer, item.after_steps - done, first=done)
        done = item.after_steps
        path = Path(item.path)
        dtype = getattr(torch, item.dtype) if item.dtype else None
        # Built on every rank, as a trainer would; only rank 0 touches the directory.
        store = ShardedStore(path.parent) if item.full else ShardedWeightsStore(path.parent, dtype=dtype)
        assert store.path(done) == path
        trainer_state = {"backend": "test", "lr_scheduler": {"last_epoch": done}}
        assert store.save(done, model, optimizer, step=done, trainer_state=trainer_state) == path
        assert path.is_dir()  # on every rank, once save returns
        snapshot(model, optimizer, Path(item.expected))


@dataclass(frozen=True, slots=True)
class Load:
    """Load ``path`` (optimizer from ``optimizer_from`` if given) into a freshly built model
    whose optimizer has taken one step of its own, snapshot to ``out``, then train a step."""

    path: str
    out: str
    optimizer_from: str | None = None


def load_and_snapshot(loads: list[Load]) -> None:
    for item in loads:
        model, optimizer = build(seed=1)  # other weights than the saved run's
        train(model, optimizer, 1, first=99)  # and moments of its own, to be overwritten
        manifest = load_sharded(
            Path(item.path),
            model,
            optimizer,
            optimizer_from=Path(item.optimizer_from) if item.optimizer_from else None,
        )
        cleared = not optimizer.state
        snapshot(model, optimizer, Path(item.out), manifest=manifest, cleared=cleared)
        train(model, optimizer, 1, first=100)  # the loaded state trains
    missing = Path(loads[0].path).with_name("v999999")
    try:
        load_sharded(missing, *build(seed=2))
    except CheckpointError as exc:
        assert "does not exist" in str(exc), exc  # on every rank, none left waiting
    else:
        raise AssertionError("loading a missing checkpoint did not raise")
