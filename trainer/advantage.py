"""Advantages: rollout rewards -> one advantage per rollout (credit assignment).

Owns three estimators and :func:`compute_advantages`, which picks one by name: GRPO and RLOO are
thin layers over verl's ``core_algos`` that take and return plain Python numbers; REINFORCE is
plain arithmetic. It does not own where rewards come from (the store's ``RewardReported`` events)
nor how an advantage is spread over tokens (the trainers broadcast a rollout's advantage to every
token it sampled, in all of its samples).

The numerics, within a group (the rollouts of one task) of ``n`` rollouts with rewards ``r``:

- GRPO (verl, epsilon 1e-6): ``A_i = (r_i - mean(r)) / (std(r) + eps)`` where ``std`` is torch's
  unbiased standard deviation (divides by ``n - 1``); with ``norm_by_std=False`` (Dr. GRPO)
  ``A_i = r_i - mean(r)``.
- RLOO (verl): ``A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r))``: the baseline is the
  mean of the *other* rollouts, so it does not depend on the rollout's own reward.
- REINFORCE: ``A_i = r_i - b`` with ``b`` 0 (no baseline), a constant, or the mean reward of
  the whole step (``"batch"``); groups play no part in the value.

Zero-variance groups. A group whose rewards are all equal (a singleton included) carries no
relative signal: GRPO and RLOO give it exactly 0 and count it in ``zero_variance_groups``. One
deliberate departure from verl: verl gives a singleton its raw reward (mean 0, std 1); here it is
0 like any other zero-variance group. REINFORCE counts such groups too and by default skips them
as well (``skip_zero_variance=True``); pass False for the textbook estimator, whose all-ones group
still pushes its samples up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_rloo_outcome_advantage

#: Added to the group's std before dividing (verl's default).
EPSILON = 1e-6

AdvantageMode = Literal["grpo", "rloo", "reinforce"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)

# verl ships py.typed but leaves these unannotated: give them their types once, here.
_VerlEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_grpo: _VerlEstimator = compute_grpo_outcome_advantage
_rloo: _VerlEstimator = compute_rloo_outcome_advantage


@dataclass(frozen=True, slots=True)
class AdvantageResult:
    """Per-rollout advantages, in the order of the rewards given."""

    advantages: list[float]
    #: Groups whose rewards are all equal (singletons included): their advantages are all 0.
    zero_variance_groups: int


def _check(rewards: Sequence[float], groups: Sequence[str]) -> None:
    if len(rewards) != len(groups):
        raise ValueError(f"got {len(rewards)} rewards for {len(groups)} group ids")


def _members(groups: Sequence[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    return members


def _zero_variance(
    values: list[float], rewards: Sequence[float], groups: Sequence[str], *, skip: bool = True
) -> AdvantageResult:
    """Count the groups whose rewards are all equal (singletons too) and, with ``skip``, set
    their advantages to exactly 0.0. Rewards are compared exactly: they are reported values, so
    equal means the rollouts could not be told apart."""
    zero_variance = 0
    for indices in _members(groups).values():
        if len({float(rewards[i]) for i in indices}) == 1:
            zero_variance += 1
            if skip:
                for i in indices:
                    values[i] = 0.0
    return AdvantageResult(advantages=values, zero_variance_groups=zero_variance)


def _verl_outcome(
    estimator: _VerlEstimator, rewards: Sequence[float], groups: Sequence[str], **kw: Any
) -> list[float]:
    # verl works on token-level tensors of shape (rollouts, response_length) and sums each row
    # into the rollout's score. One column holding the reward gives exactly that score; the
    # result is the advantage broadcast over the (single-column) response mask.
    # float64 so that rewards such as 0.1 are not rounded before the mean/std.
    scores = torch.tensor([float(r) for r in rewards], dtype=torch.float64).unsqueeze(-1)
    advantages, _returns = estimator(
        token_level_rewards=scores,
        response_mask=torch.ones_like(scores),
        index=np.array(list(groups), dtype=object),
        epsilon=EPSILON,
        **kw,
    )
    return [float(a) for a in advantages[:, 0].tolist()]


def grpo_advantages(
    rewards: Sequence[float], groups: Sequence[str], *, norm_by_std: bool = True
) -> AdvantageResult:
    """Group-relative advantages of rollouts: ``rewards[i]`` belongs to group ``groups[i]``."""
    _check(rewards, groups)
    if not rewards:
        return AdvantageResult(advantages=[], zero_variance_groups=0)
    # verl already gives a group of n >= 2 equal rewards (r - r) / (0 + eps) == 0; a singleton
    # it would give its raw reward (see the module docstring). Both become an exact 0.0.
    values = _verl_outcome(_grpo, rewards, groups, norm_adv_by_std_in_grpo=norm_by_std)
    return _zero_variance(values, rewards, groups)


def rloo_advantages(rewards: Sequence[float], groups: Sequence[str]) -> AdvantageResult:
    """Leave-one-out advantages: each rollout against the mean of the others of its group."""
    _check(rewards, groups)
    if not rewards:
        return AdvantageResult(advantages=[], zero_variance_groups=0)
    return _zero_variance(_verl_outcome(_rloo, rewards, groups), rewards, groups)


def reinforce_advantages(
    rewards: Sequence[float],
    groups: Sequence[str],
    *,
    baseline: float | Literal["batch"] | None = None,
    skip_zero_variance: bool = True,
) -> AdvantageResult:
    """Plain REINFORCE: ``A_i = r_i - b`` (``b`` = 0, a constant, or the step's mean reward)."""
    _check(rewards, groups)
    if not rewards:
        return AdvantageResult(advantages=[], zero_variance_groups=0)
    if baseline == "batch":
        b = sum(float(r) for r in rewards) / len(rewards)
    elif baseline is None:
        b = 0.0
    elif isinstance(baseline, int | float):
        b = float(baseline)
    else:
        raise ValueError(f"baseline must be None, a number or 'batch', got {baseline!r}")
    values = [float(r) - b for r in rewards]
    return _zero_variance(values, rewards, groups, skip=skip_zero_variance)


def compute_advantages(
    mode: AdvantageMode,
    rewards: Sequence[float],
    groups: Sequence[str],
    *,
    norm_by_std: bool = True,
    baseline: float | Literal["batch"] | None = None,
    skip_zero_variance: bool = True,
) -> AdvantageResult:
    """The advantages of ``mode`` ("grpo", "rloo" or "reinforce"); the options of the others
    are ignored (``norm_by_std`` is GRPO's, ``baseline`` and ``skip_zero_variance`` REINFORCE's)."""
    if mode == "grpo":
        return grpo_advantages(rewards, groups, norm_by_std=norm_by_std)
    if mode == "rloo":
        return rloo_advantages(rewards, groups)
    if mode == "reinforce":
        return reinforce_advantages(rewards, groups, baseline=baseline, skip_zero_variance=skip_zero_variance)
    raise ValueError(f"unknown advantage mode {mode!r}; use one of {', '.join(ADVANTAGE_MODES)}")
