"""A verl training step decided once and split over the trainer's ranks.

Owns :class:`StepPlan` (items -> mini-batches of weighted rows, and which of them train),
:func:`plan_step`, :func:`shard` (one rank's share of each mini-batch, :class:`RankStep`) and
:func:`finish` (the ranks' :class:`RankResult` -> one :class:`~trainer.items.StepOutput`), and
:func:`weighted_rows`, and :class:`LossTotals`, the sums a step's micro-batches add up. It is
light (no verl, no model): the driver plans in the appliance's process, each rank runs its share
(``trainer.verl_backend.VerlFSDPTrainer.run_step``), and a world-size-1 trainer does all three;
so does the torch backend (``trainer.policy``), with one mini-batch on one process.

Why the plan is made once. Every decision that makes ranks call collectives (whether a
mini-batch trains or only runs forward, whether proximal log-probs are precomputed) must be the
same on every rank, or the ranks wait on each other forever. And the loss is additive: each
row's per-token weight is fixed here, over the whole step (``trainer.normalization``), and the
loss is a token sum, so where a row runs does not change the gradient (verl scales each rank's
token sum by the world size, and FSDP averages the gradients). Rows are dealt longest first to
the rank with the fewest tokens so far. A rank left without a row in a mini-batch gets an inert
copy of one (its loss mask all zero): it still takes part in the collectives and adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.items import StepOutput, TrainItem, check_items, has_signal, reward_stats, trainable_tokens
from trainer.items import truncate_items as _truncate_items
from trainer.normalization import Normalization, sample_weights
from trainer.options import TrainerOptions
from trainer.samples import Sample

#: One row of a batch: a sample (with at least one trainable token), its rollout's advantage,
#: its per-token normalization weight.
Row = tuple[Sample, float, float]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: per mini-batch, its rows (empty: nothing trainable) and whether it trains."""

    minibatches: tuple[tuple[Row, ...], ...]
    #: Per mini-batch: an optimizer step (True) or a forward pass only (no advantage is non-zero).
    trains: tuple[bool, ...]
    #: Proximal log-probs computed before the first update (decoupled mode, several mini-batches).
    precompute_old: bool
    samples: int
    rollouts: int
    truncated_samples: int
    reward_mean: float | None
    reward_std: float | None


@dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's share of a :class:`StepPlan`: rows per mini-batch, the last ``inert[i]`` of
    which are padding (loss mask zero)."""

    rows: tuple[tuple[Row, ...], ...]
    inert: tuple[int, ...]
    trains: tuple[bool, ...]
    precompute_old: bool


@dataclass(slots=True)
class LossTotals:
    """Token sums (not means) over the micro-batches a process ran in one step: the torch
    backend's whole step, or one verl rank's share (means are taken by :func:`finish`). A verl
    rank's ``loss`` is its share as verl computes it: scaled by the world size."""

    loss: float = 0.0
    tokens: int = 0
    clipfrac_sum: float = 0.0
    ppo_kl_sum: float = 0.0
    entropy_sum: float = 0.0
    kl_ref_sum: float = 0.0
    is_weight_sum: float = 0.0
    is_capped_sum: float = 0.0


@dataclass(frozen=True, slots=True)
class RankResult:
    """What one rank did in a step."""

    stats: LossTotals
    #: Per mini-batch that had rows: the total gradient norm (0.0 for a forward-only one); the
    #: norm is over all ranks' shards, so every rank reports the same.
    grad_norms: tuple[float, ...]
    updated: bool
    step: int


def weighted_rows(items: Sequence[TrainItem], normalization: Normalization) -> list[Row]:
    """The rows of ``items``: each sample with a trainable token, its rollout's advantage and
    its per-token weight (``sample_weights`` over ``items``)."""
    weights = sample_weights([it.samples for it in items], normalization)
    return [
        (sample, it.advantage, w)
        for it, row in zip(items, weights, strict=True)
        for sample, w in zip(it.samples, row, strict=True)
        if trainable_tokens(sample) > 0
    ]


def plan_step(items: Sequence[TrainItem], options: TrainerOptions, mini_batches: int = 1) -> StepPlan:
    """Check and truncate ``items`` (``options.max_sample_tokens``), deal them into
    ``mini_batches`` chunks (``items[i::m]``), and weigh each chunk's samples
    (``sample_weights`` over the chunk, ``options.normalization``)."""
    check_items(items)
    items = _truncate_items(items, options.max_sample_tokens, options.overflow)
    chunks = [list(items[i::mini_batches]) for i in range(mini_batches)]
    chunks = [chunk for chunk in chunks if chunk]
    minibatches = [tuple(weighted_rows(chunk, options.normalization)) for chunk in chunks]
    reward_mean, reward_std = reward_stats(items)
    return StepPlan(
        minibatches=tuple(minibatches),
        trains=tuple(has_signal(chunk) for chunk in chunks),
        precompute_old=options.off_policy == "decoupled" and len(chunks) > 1,
        samples=sum(len(it.samples) for it in items),
        rollouts=len(items),
        truncated_samples=sum(1 for it in items for s in it.samples if s.truncation is not None),
        reward_mean=reward_mean,
        reward_std=reward_std,
    )


def shard(plan: StepPlan, rank: int, world_size: int) -> RankStep:
    """Rank ``rank``'s rows of every mini-batch (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    rows: list[tuple[Row, ...]] = []
    inert: list[int] = []
    for batch in plan.minibatches:
        if not batch:
            rows.append(())
            inert.append(0)
            continue
        dealt = _deal(batch, world_size)
        mine = dealt[rank]
        if mine:
            rows.append(tuple(mine))
            inert.append(0)
        else:
            shortest = min(batch, key=lambda row: len(row[0].tokens))
            rows.append(((shortest[0], 0.0, 0.0),))
            inert.append(1)
    return RankStep(
        rows=tuple(rows), inert=tuple(inert), trains=plan.trains, precompute_old=plan.precompute_old
    )


def _deal(batch: Sequence[Row], world_size: int) -> list[list[Row]]:
    """Rows longest first, each to the rank with the fewest tokens so far (lowest rank on ties);
    each rank's rows keep the batch's order."""
    load = [0] * world_size
    owner: dict[int, int] = {}
    for index in sorted(range(len(batch)), key=lambda i: (-len(batch[i][0].tokens), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += len(batch[index][0].tokens)
    dealt: list[list[Row]] = [[] for _ in range(world_size)]
    for index, row in enumerate(batch):
        dealt[owner[index]].append(row)
    return dealt


def finish(plan: StepPlan, results: Sequence[RankResult], duration_s: float) -> StepOutput:
    """The step's output from every rank's result (sums over ranks; the loss unscaled)."""
    if not results:
        raise ValueError("a step needs the result of at least one rank")
    world = len(results)
    total = LossTotals()
    for result in results:
        s = result.stats
        total.loss += s.loss / world
        total.tokens += s.tokens
        total.clipfrac_sum += s.clipfrac_sum
        total.ppo_kl_sum += s.ppo_kl_sum
        total.entropy_sum += s.entropy_sum
        total.kl_ref_sum += s.kl_ref_sum
        total.is_weight_sum += s.is_weight_sum
        total.is_capped_sum += s.is_capped_sum
    grad_norms = results[0].grad_norms
    n = max(total.tokens, 1)
    return StepOutput(
        step=results[0].step,
        updated=any(r.updated for r in results),
        loss=total.loss / max(len(grad_norms), 1),
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        pg_clipfrac=total.clipfrac_sum / n,
        ppo_kl=total.ppo_kl_sum / n,
        entropy=total.entropy_sum / n,
        tokens=total.tokens,
        samples=plan.samples,
        rollouts=plan.rollouts,
        duration_s=duration_s,
        kl_ref=total.kl_ref_sum / n,
        is_weight_mean=total.is_weight_sum / n if total.tokens else 1.0,
        is_capped_frac=total.is_capped_sum / n,
        truncated_samples=plan.truncated_samples,
        reward_mean=plan.reward_mean,
        reward_std=plan.reward_std,
    )
