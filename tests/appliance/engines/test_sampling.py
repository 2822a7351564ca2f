"""Token choice and reported log-probs on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from appliance.engines.sampling import choose_tokens, draw_top_p

# Probabilities 0.5, 0.3, 0.15, 0.05 at T = 1.
LOGITS = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])


def test_greedy_takes_argmax_and_reports_temperature_one() -> None:
    tokens, logprobs, _ = choose_tokens(LOGITS * 3, [0.0], [1.0], [None])
    assert tokens == [0]
    assert logprobs[0] == pytest.approx(torch.log_softmax(LOGITS[0] * 3, -1)[0].item())


def test_logprob_is_of_the_tempered_unfiltered_distribution() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs, _ = choose_tokens(LOGITS, [0.5], [0.5], [generator])
    # Top-p 0.5 at T = 0.5 keeps token 0 alone (its tempered mass is 0.25 / 0.3650 > 0.5) ...
    assert tokens == [0]
    # ... but the reported log-prob is that of the full tempered distribution, not log(1).
    assert logprobs[0] == pytest.approx(math.log(0.25 / (0.25 + 0.09 + 0.0225 + 0.0025)))


@pytest.mark.parametrize(
    ("top_p", "allowed"), [(1.0, {0, 1, 2, 3}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.4, {0})]
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, allowed: set[int]) -> None:
    generator = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(LOGITS[0], -1)
    drawn = {int(draw_top_p(logp, top_p, generator)) for _ in range(400)}
    assert drawn == allowed


def test_seeded_rows_are_independent_of_their_neighbours() -> None:
    logits = torch.zeros(3, 50)

    def row_one(neighbour_seed: int) -> int:
        gens = [torch.Generator().manual_seed(s) for s in (neighbour_seed, 7, neighbour_seed + 1)]
        return choose_tokens(logits, [1.0, 1.0, 1.0], [1.0] * 3, gens)[0][1]

    assert row_one(0) == row_one(100) == row_one(5)


def test_top_logprobs_are_the_most_likely_tokens_in_order() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    _, _, tops = choose_tokens(logits, [1.0, 0.0], [1.0, 1.0], [None, None], [3, 0])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert [t for t, _ in tops[0]] == [1, 3, 2]
    assert [lp for _, lp in tops[0]] == pytest.approx(
        [expected[1].item(), expected[3].item(), expected[2].item()]
    )
    assert tops[1] == ()
