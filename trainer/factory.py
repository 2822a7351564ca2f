"""Choosing a training backend by name: :func:`make_trainer`.

Owns the names of the backends and which class each one builds. It does not own the backends
(``trainer.policy``: plain torch + transformers on one device; ``trainer.verl_backend``: verl's
FSDP engine) nor the configuration that picks one (the appliance's config).

Both take ``model_dir`` and the keywords of ``trainer.options.TrainerOptions``; only "verl" has
those ``trainer.options.VerlOptions`` adds (:data:`VERL_ONLY_OPTIONS`, named here too so that
choosing a backend stays light).

``ranks``: None builds the trainer in this process (world size 1). A number builds verl's trainer
as that many worker processes (``trainer.ranks.RankedTrainer``: one per GPU, or processes on gloo
on CPU), which is how the appliance runs it; the torch backend trains in one process only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from trainer.items import Trainer

Backend = Literal["torch", "verl"]
BACKENDS: tuple[str, ...] = get_args(Backend)

#: Options only the verl backend understands.
VERL_ONLY_OPTIONS = frozenset(
    {
        "kl_coef",
        "kl_type",
        "lora_rank",
        "lora_alpha",
        "mini_batches",
        "param_dtype",
        "gradient_checkpointing",
        "remove_padding",
    }
)


def make_trainer(
    backend: Backend,
    model_dir: str | Path,
    *,
    ranks: int | None = None,
    threads: int | None = None,
    gpus: Sequence[int] | None = None,
    **options: Any,
) -> Trainer:
    """A trainer of ``backend`` ("torch" or "verl") for the model in ``model_dir``.

        Raises ``ValueError`` for an unknown backend, for verl-only options given to "torch"
        (rather than silently training without, say, the KL term that was asked for), or for more
        than one rank with "torch". ``threads``: torch threads of each rank process; ``gpus``: the GPU
    of each rank (the placement's training GPUs; None: rank r on GPU r).
    """
    if ranks is not None and ranks < 1:
        raise ValueError(f"a trainer needs at least one rank, got {ranks}")
    if backend == "torch":
        if ranks is not None and ranks > 1:
            raise ValueError(
                f"{ranks} trainer ranks need backend='verl'; the torch backend trains in one process"
            )
        unsupported = sorted(VERL_ONLY_OPTIONS & options.keys())
        if unsupported:
            raise ValueError(f"options {unsupported} need backend='verl'; the torch backend has none of them")
        from trainer.policy import PolicyTrainer  # heavy imports: only the chosen backend's

        return PolicyTrainer(model_dir, **options)
    if backend == "verl":
        if ranks is not None:
            from trainer.ranks import RankedTrainer

            return RankedTrainer(model_dir, ranks=ranks, threads=threads, gpus=gpus, **options)
        from trainer.verl_backend import VerlFSDPTrainer

        return VerlFSDPTrainer(model_dir, **options)
    raise ValueError(f"unknown trainer backend {backend!r}; use one of {', '.join(BACKENDS)}")
