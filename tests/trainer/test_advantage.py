"""The advantage estimators (GRPO, RLOO, REINFORCE) against hand computations."""

from __future__ import annotations

import math

import pytest

from trainer.advantage import (
    EPSILON,
    compute_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)


def test_one_group_normalized_by_unbiased_std() -> None:
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    result = grpo_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4)
    a = 0.5 / (math.sqrt(1 / 3) + EPSILON)
    assert result.advantages == pytest.approx([a, -a, -a, a], abs=1e-9)
    assert a == pytest.approx(0.866024, abs=1e-6)
    assert result.zero_variance_groups == 0


def test_three_rewards() -> None:
    # mean 2; unbiased std = sqrt((1 + 1 + 0) / 2) = 1
    result = grpo_advantages([3.0, 1.0, 2.0], ["g", "g", "g"])
    assert result.advantages == pytest.approx([1 / (1 + EPSILON), -1 / (1 + EPSILON), 0.0], abs=1e-9)


def test_without_std_normalization() -> None:
    result = grpo_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4, norm_by_std=False)
    assert result.advantages == pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-9)


def test_interleaved_groups_are_kept_apart() -> None:
    # group a: [1, 0] -> mean 0.5, std sqrt(0.5) = 0.70711; group b: [0.2, 0.6] -> mean 0.4, same std/2.
    result = grpo_advantages([1.0, 0.2, 0.0, 0.6], ["a", "b", "a", "b"])
    sa = math.sqrt(0.5)
    sb = math.sqrt(0.08)
    expected = [0.5 / (sa + EPSILON), -0.2 / (sb + EPSILON), -0.5 / (sa + EPSILON), 0.2 / (sb + EPSILON)]
    assert result.advantages == pytest.approx(expected, abs=1e-9)


def test_zero_variance_groups_and_singletons_get_zero() -> None:
    result = grpo_advantages(
        [1.0, 0.0, 0.5, 0.5, 0.7, 1.0, 1.0, 1.0],
        ["mixed", "mixed", "equal", "equal", "single", "ones", "ones", "ones"],
    )
    a = 0.5 / (math.sqrt(0.5) + EPSILON)
    assert result.advantages == pytest.approx([a, -a, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-9)
    # Exactly zero, not eps-small: these rollouts train nothing.
    assert result.advantages[2:] == [0.0] * 6
    assert result.zero_variance_groups == 3  # "equal", "single", "ones"


def test_empty_and_mismatched() -> None:
    empty = grpo_advantages([], [])
    assert (empty.advantages, empty.zero_variance_groups) == ([], 0)
    with pytest.raises(ValueError, match="2 rewards for 1 group"):
        grpo_advantages([1.0, 0.0], ["g"])


# --- RLOO: each rollout against the mean of the OTHER rollouts of its group -----------------------


def test_rloo_leaves_each_rollout_out_of_its_own_baseline() -> None:
    # [1, 0, 0, 1]: 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    result = rloo_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4)
    assert result.advantages == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-12)
    # [3, 1, 2]: 3 - 1.5 = 1.5 ; 1 - 2.5 = -1.5 ; 2 - 2 = 0
    result = rloo_advantages([3.0, 1.0, 2.0], ["g"] * 3)
    assert result.advantages == pytest.approx([1.5, -1.5, 0.0], abs=1e-12)
    assert result.zero_variance_groups == 0


def test_rloo_groups_and_zero_variance() -> None:
    # a: [1, 0.5] -> 1 - 0.5 = 0.5, 0.5 - 1 = -0.5 ; b: equal -> 0 ; c: singleton -> 0 (verl: raw 0.9)
    result = rloo_advantages([1.0, 0.2, 0.5, 0.2, 0.9], ["a", "b", "a", "b", "c"])
    assert result.advantages == pytest.approx([0.5, 0.0, -0.5, 0.0, 0.0], abs=1e-12)
    assert result.advantages[4] == 0.0
    assert result.zero_variance_groups == 2


def test_rloo_is_grpo_without_std_scaled_by_n_over_n_minus_1() -> None:
    rewards, groups = [0.3, 0.9, 0.1, 0.4], ["g"] * 4
    dr_grpo = grpo_advantages(rewards, groups, norm_by_std=False).advantages
    assert rloo_advantages(rewards, groups).advantages == pytest.approx(
        [4 / 3 * a for a in dr_grpo], abs=1e-12
    )


# --- REINFORCE: the plain reward, optionally minus a baseline --------------------------------------


def test_reinforce_without_baseline_is_the_reward() -> None:
    result = reinforce_advantages([1.0, 0.0, 0.25], ["a", "a", "b"], skip_zero_variance=False)
    assert result.advantages == [1.0, 0.0, 0.25]
    # "b" is a singleton: counted, but kept since skipping was turned off.
    assert result.zero_variance_groups == 1


def test_reinforce_with_constant_and_batch_baselines() -> None:
    rewards, groups = [1.0, 0.0, 0.5, 1.0], ["a", "a", "b", "b"]
    assert reinforce_advantages(rewards, groups, baseline=0.5).advantages == [0.5, -0.5, 0.0, 0.5]
    # batch mean = 2.5 / 4 = 0.625
    batch = reinforce_advantages(rewards, groups, baseline="batch")
    assert batch.advantages == pytest.approx([0.375, -0.625, -0.125, 0.375], abs=1e-12)
    assert batch.zero_variance_groups == 0


def test_reinforce_skips_zero_variance_groups_by_default() -> None:
    rewards, groups = [1.0, 1.0, 1.0, 0.0], ["ones", "ones", "mixed", "mixed"]
    skipped = reinforce_advantages(rewards, groups)
    assert skipped.advantages == [0.0, 0.0, 1.0, 0.0]
    assert skipped.zero_variance_groups == 1
    kept = reinforce_advantages(rewards, groups, skip_zero_variance=False)
    assert kept.advantages == [1.0, 1.0, 1.0, 0.0]
    assert kept.zero_variance_groups == 1


def test_reinforce_rejects_a_bad_baseline() -> None:
    with pytest.raises(ValueError, match="baseline must be"):
        reinforce_advantages([1.0], ["g"], baseline="mean")  # type: ignore[arg-type]


# --- choosing by name -----------------------------------------------------------------------------


def test_compute_advantages_dispatches_by_mode() -> None:
    rewards, groups = [1.0, 0.0, 0.0, 1.0], ["g"] * 4
    assert compute_advantages("grpo", rewards, groups) == grpo_advantages(rewards, groups)
    assert compute_advantages("grpo", rewards, groups, norm_by_std=False).advantages == [0.5, -0.5, -0.5, 0.5]
    assert compute_advantages("rloo", rewards, groups) == rloo_advantages(rewards, groups)
    assert compute_advantages("reinforce", rewards, groups, baseline="batch").advantages == [
        0.5,
        -0.5,
        -0.5,
        0.5,
    ]
    for mode in ("rloo", "reinforce"):
        assert compute_advantages(mode, [], []).advantages == []
        with pytest.raises(ValueError, match="2 rewards for 1 group"):
            compute_advantages(mode, [1.0, 0.0], ["g"])
    with pytest.raises(ValueError, match="unknown advantage mode 'ppo'; use one of grpo, rloo, reinforce"):
        compute_advantages("ppo", rewards, groups)  # type: ignore[arg-type]
