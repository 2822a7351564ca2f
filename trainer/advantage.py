"""Advantages: rollout rewards -> group-relative (GRPO) advantages, one number per rollout.

Owns :func:`grpo_advantages`, a thin layer over verl's ``compute_grpo_outcome_advantage`` that
takes and returns plain Python numbers. It does not own where rewards come from (the store's
``RewardReported`` events) nor how an advantage is spread over tokens (``trainer.policy``
broadcasts it to every sampled token of the rollout).

The numerics (verl's, with epsilon 1e-6): within a group of ``n >= 2`` rollouts with rewards
``r``, ``A_i = (r_i - mean(r)) / (std(r) + eps)`` where ``std`` is torch's unbiased standard
deviation (divides by ``n - 1``); with ``norm_by_std=False`` (Dr. GRPO) ``A_i = r_i - mean(r)``.

One deliberate departure from verl: verl gives a group of ONE rollout mean 0 and std 1, i.e. its
raw reward as the advantage (REINFORCE without a baseline). Here a singleton, like any group
whose rewards are all equal, has nothing to be compared with: its advantage is 0 and it is
counted in ``zero_variance_groups``. (For a group of equal rewards verl already yields exactly 0.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

#: Added to the group's std before dividing (verl's default).
EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class AdvantageResult:
    """Per-rollout advantages, in the order of the rewards given."""

    advantages: list[float]
    #: Groups whose rewards are all equal (singletons included): their advantages are all 0.
    zero_variance_groups: int


def grpo_advantages(
    rewards: Sequence[float], groups: Sequence[str], *, norm_by_std: bool = True
) -> AdvantageResult:
    """Group-relative advantages of rollouts: ``rewards[i]`` belongs to group ``groups[i]``."""
    if len(rewards) != len(groups):
        raise ValueError(f"got {len(rewards)} rewards for {len(groups)} group ids")
    if not rewards:
        return AdvantageResult(advantages=[], zero_variance_groups=0)

    # verl works on token-level tensors of shape (rollouts, response_length) and sums each row
    # into the rollout's score. One column holding the reward gives exactly that score; the
    # result is the advantage broadcast over the (single-column) response mask.
    # float64 so that rewards such as 0.1 are not rounded before the mean/std.
    scores = torch.tensor([float(r) for r in rewards], dtype=torch.float64).unsqueeze(-1)
    response_mask = torch.ones_like(scores)
    index = np.array(list(groups), dtype=object)
    advantages, _returns = compute_grpo_outcome_advantage(
        token_level_rewards=scores,
        response_mask=response_mask,
        index=index,
        epsilon=EPSILON,
        norm_adv_by_std_in_grpo=norm_by_std,
    )
    values = [float(a) for a in advantages[:, 0].tolist()]

    # Zero-variance groups: all rewards equal (compared exactly: rewards are reported values, so
    # equal means the rollouts could not be told apart). verl already gives a group of n >= 2
    # equal rewards (r - r) / (0 + eps) == 0; a singleton it would give its raw reward (see the
    # module docstring). Both become an exact 0.0.
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    zero_variance = 0
    for indices in members.values():
        if len({float(rewards[i]) for i in indices}) == 1:
            zero_variance += 1
            for i in indices:
                values[i] = 0.0
    return AdvantageResult(advantages=values, zero_variance_groups=zero_variance)
