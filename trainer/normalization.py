"""Loss normalization: how much each trained token weighs in a step's loss.

Owns :func:`sample_weights`, the per-token weight of every sample of a step under one of three
modes. It does not own the per-token loss (verl's policy losses, in ``trainer.policy`` and
``trainer.verl_backend``); both backends multiply each token's loss by the weight given here and
**sum** (verl's ``token-sum`` aggregation), so the step's loss is ``sum_t w_t * l_t``.

Counting only trainable tokens (``trainer.items.trainable_tokens``), with ``T`` of them in the
step, sample ``s`` having ``N_s`` and rollout ``r`` having ``N_r`` over all its samples, and
``S`` / ``R`` the samples / rollouts that have at least one:

- ``"rollout"`` (the default): ``w_t = 1 / (R * N_r)``. Every rollout weighs the same, however
  many samples (segments) and tokens it produced: ``loss = mean_r mean_{t in r} l_t``. A long
  multi-call agent rollout does not outvote a short one, and splitting a rollout into more
  samples (a prefix break) changes nothing.
- ``"sample"``: ``w_t = 1 / (S * N_s)``. Every sample weighs the same (verl's
  ``seq-mean-token-mean``): a rollout with three segments counts three times.
- ``"token"``: ``w_t = 1 / T``. Every token weighs the same (verl's ``token-mean``): long
  rollouts dominate.

In every mode the weight is constant within a sample, so it is returned per sample. The weights
of a step sum to 1 over its trainable tokens (when it has any) and they add up across
micro-batches: samples can be packed into micro-batches freely and the gradients accumulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from trainer.items import trainable_tokens
from trainer.samples import Sample

Normalization = Literal["rollout", "sample", "token"]
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)


def check_normalization(mode: str) -> Normalization:
    """``mode`` as a :data:`Normalization`, or ``ValueError`` naming the valid modes."""
    if mode not in NORMALIZATIONS:
        raise ValueError(f"unknown normalization {mode!r}; use one of {', '.join(NORMALIZATIONS)}")
    return mode  # type: ignore[return-value]  # checked just above


def sample_weights(
    rollouts: Sequence[Sequence[Sample]], mode: Normalization = "rollout"
) -> list[list[float]]:
    """The per-token weight of each sample: ``result[i][j]`` for ``rollouts[i][j]``.

    A sample without trainable tokens gets 0.0 (it adds nothing and is not counted).
    """
    check_normalization(mode)
    counts = [[trainable_tokens(s) for s in samples] for samples in rollouts]
    total_tokens = sum(sum(row) for row in counts)
    if total_tokens == 0:
        return [[0.0] * len(row) for row in counts]
    if mode == "token":
        return [[1.0 / total_tokens if n > 0 else 0.0 for n in row] for row in counts]
    if mode == "sample":
        active_samples = sum(1 for row in counts for n in row if n > 0)
        return [[1.0 / (active_samples * n) if n > 0 else 0.0 for n in row] for row in counts]
    per_rollout = [sum(row) for row in counts]
    active_rollouts = sum(1 for n in per_rollout if n > 0)
    return [
        [1.0 / (active_rollouts * n_r) if n > 0 else 0.0 for n in row]
        for row, n_r in zip(counts, per_rollout, strict=True)
    ]
