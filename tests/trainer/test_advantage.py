"""grpo_advantages: verl's group-relative advantages against hand computations."""

from __future__ import annotations

import math

import pytest

from trainer.advantage import EPSILON, grpo_advantages


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
