"""The staleness bound applied to samples before a step."""

from __future__ import annotations

from appliance.training.batch import bound_staleness
from trainer.samples import Sample


def sample(versions: tuple[int, ...], mask: tuple[int, ...]) -> Sample:
    n = len(versions)
    return Sample(
        rollout="r",
        call_ids=("c",),
        tokens=tuple(range(n)),
        loss_mask=mask,
        logprobs=tuple(-0.5 if m else 0.0 for m in mask),
        versions=versions,
    )


def test_tokens_older_than_eta_are_masked_and_counted() -> None:
    # Prompt tokens (-1, mask 0) are never counted; sampled tokens of versions 1, 2, 3 against
    # current version 3 with eta 1: only version-1 tokens are too old.
    original = sample((-1, -1, 1, 1, 2, 3), (0, 0, 1, 1, 1, 1))
    bounded, stale = bound_staleness(original, current_version=3, eta=1)
    assert stale == 2
    assert bounded.loss_mask == (0, 0, 0, 0, 1, 1)
    assert bounded.tokens == original.tokens


def test_no_bound_or_nothing_stale_leaves_the_sample_alone() -> None:
    original = sample((-1, 2, 3), (0, 1, 1))
    assert bound_staleness(original, current_version=3, eta=None) == (original, 0)
    assert bound_staleness(original, current_version=3, eta=1) == (original, 0)
