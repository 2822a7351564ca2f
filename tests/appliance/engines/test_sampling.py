"""Token choice and reported log-probs on hand-made logits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from appliance.engines import sampling
from appliance.engines.sampling import choose_tokens, draw_rows, draw_top_p

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


# --- top-k: the k most likely tokens, renormalised, then top-p of what is left -----------------


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution Hugging Face's warpers (temperature, top-k, then top-p, as vLLM orders
    them) sample ``logits`` (vocab,) from, in float64."""
    scores = (logits.double() / temperature)[None, :]
    if top_k:
        scores = TopKLogitsWarper(top_k)(torch.zeros(1, 0, dtype=torch.long), scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(torch.zeros(1, 0, dtype=torch.long), scores)
    return torch.softmax(scores[0], dim=-1)


def assert_fits(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Draws (``counts`` per token) fit ``probs``: none outside its support, and a chi-square
    statistic (tokens expected fewer than 20 times pooled) within its mean plus 6 standard
    deviations."""
    n = float(counts.sum())
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    expected = probs * n
    big = expected >= 20
    observed, wanted = counts[big].double(), expected[big]
    if expected[~big].sum() > 0:
        observed = torch.cat([observed, counts[~big].sum()[None].double()])
        wanted = torch.cat([wanted, expected[~big].sum()[None]])
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    df = len(wanted) - 1
    assert df >= 1 and chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


def test_top_k_one_is_greedy_at_any_temperature_and_top_p() -> None:
    torch.manual_seed(1)
    logits = torch.randn(12, 3000) * 3
    temperatures = [0.3, 1.0, 2.5, 7.0] * 3
    top_ps = [1.0, 0.9, 0.5] * 4
    generators = [torch.Generator().manual_seed(i) for i in range(12)]
    tokens, logprobs, _ = choose_tokens(logits, temperatures, top_ps, generators, top_ks=[1] * 12)
    assert tokens == logits.argmax(dim=-1).tolist()
    # The reported log-probs are the tempered, uncut policy's, as for any sampled row.
    tempered = torch.log_softmax(logits / torch.tensor(temperatures)[:, None], dim=-1)
    assert logprobs == pytest.approx(tempered[range(12), tokens].tolist(), abs=1e-6)
    # The same rows without top-k do not all land on the argmax: the cut is what made them greedy.
    free, _, _ = choose_tokens(logits, temperatures, top_ps, [None] * 12)
    assert free != tokens


@pytest.mark.parametrize(("k", "top_p"), [(5, 1.0), (40, 1.0), (5, 0.6), (300, 0.95), (600, 0.9)])
def test_top_k_draws_only_the_k_most_likely_in_their_renormalised_proportions(k: int, top_p: float) -> None:
    """Many seeded draws stay among the k most likely tokens and follow Hugging Face's
    top-k-then-top-p distribution, also where the nucleus of the k kept tokens is wider than the
    first search window (300 and 600 of a flat 2000-token vocabulary)."""
    torch.manual_seed(k)
    logits = torch.randn(2000) * (2.0 if k < 100 else 0.3)
    n = 8000
    draws = draw_rows(
        torch.log_softmax(logits, dim=-1).expand(n, -1),
        [top_p] * n,
        [torch.Generator().manual_seed(seed) for seed in range(n)],
        [k] * n,
    )
    allowed = set(logits.topk(k).indices.tolist())
    assert set(draws.tolist()) <= allowed
    assert_fits(torch.bincount(draws, minlength=2000), reference_probs(logits, 1.0, k, top_p))


@pytest.mark.parametrize(
    ("top_k", "top_p", "allowed"),
    [
        (2, 1.0, {0, 1}),
        (3, 1.0, {0, 1, 2}),
        # Top-p measures the renormalised top-k distribution: 0.5 / 0.8 = 0.625 reaches 0.6 ...
        (2, 0.6, {0}),
        # ... and 0.8 / 0.95 = 0.842 reaches 0.83, where the uncut 0.8 would not.
        (3, 0.83, {0, 1}),
        (3, 0.85, {0, 1, 2}),
        (0, 0.75, {0, 1}),
        # At least the vocabulary's size: no cut.
        (4, 1.0, {0, 1, 2, 3}),
        (10**6, 1.0, {0, 1, 2, 3}),
    ],
)
def test_top_k_composes_with_top_p(top_k: int, top_p: float, allowed: set[int]) -> None:
    generator = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(LOGITS[0], -1)
    drawn = {int(draw_top_p(logp, top_p, generator, top_k)) for _ in range(400)}
    assert drawn == allowed


def test_tokens_tied_with_the_kth_most_likely_stay() -> None:
    """As in vLLM and Hugging Face, top-k cuts below the k-th largest log-prob, not after k tokens."""
    logp = torch.log_softmax(torch.tensor([2.0, 1.0, 1.0, 0.0]), -1)
    generator = torch.Generator().manual_seed(0)
    assert {int(draw_top_p(logp, 1.0, generator, 2)) for _ in range(300)} == {0, 1, 2}


def test_top_k_frequencies_are_the_renormalised_probabilities() -> None:
    """Top-2 of 0.5, 0.3, 0.15, 0.05 draws token 0 with probability 0.625 and token 1 with 0.375."""
    n = 4000
    logp = torch.log_softmax(LOGITS[0], -1)
    draws = draw_rows(logp.expand(n, -1), [1.0] * n, [torch.Generator().manual_seed(7)] * n, [2] * n)
    counts = torch.bincount(draws, minlength=4)
    assert counts[2:].sum() == 0
    # Binomial standard deviation sqrt(4000 * 0.625 * 0.375) ~ 31: 4 of them either way.
    assert abs(int(counts[0]) - 0.625 * n) < 4 * 31


def test_top_k_ranks_only_what_a_grammar_allows() -> None:
    """Masked (-inf) tokens are never drawn: with fewer allowed tokens than k every allowed one
    may be, in the policy's proportions, and with more, only the k most likely of them."""
    torch.manual_seed(3)
    logits = torch.randn(500) * 2
    forbidden = logits.topk(10).indices  # the grammar forbids the ten most likely tokens
    masked = logits.index_fill(0, forbidden, -float("inf"))
    n = 4000
    for k in (50, 600):
        draws = draw_rows(torch.log_softmax(masked, -1).expand(n, -1), [1.0] * n, [None] * n, [k] * n)
        assert not set(draws.tolist()) & set(forbidden.tolist())
        assert_fits(torch.bincount(draws, minlength=500), reference_probs(masked, 1.0, k, 1.0))


def test_rows_of_one_batch_keep_their_own_top_k() -> None:
    """Top-k per row: a row without it draws what it draws in a batch with no top-k at all, a
    top-1 row is greedy, a top-3 row stays in its three, and a greedy row ignores its top_k."""
    torch.manual_seed(4)
    logits = torch.randn(4, 800) * 2
    n = 200
    for seed in range(n):
        gens = [torch.Generator().manual_seed(seed + 1000 * i) for i in range(4)]
        tokens, logprobs, _ = choose_tokens(
            logits, [1.0, 1.0, 1.0, 0.0], [1.0] * 4, gens, top_ks=[0, 1, 3, 2]
        )
        plain_gens = [torch.Generator().manual_seed(seed + 1000 * i) for i in range(4)]
        plain, plain_logprobs, _ = choose_tokens(logits, [1.0, 1.0, 1.0, 0.0], [1.0] * 4, plain_gens)
        assert tokens[0] == plain[0] and logprobs[0] == plain_logprobs[0]
        assert tokens[1] == int(logits[1].argmax())
        assert tokens[2] in logits[2].topk(3).indices.tolist()
        assert tokens[3] == plain[3] == int(logits[3].argmax())


def test_rows_without_top_k_never_rank_their_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 and values of at least the vocabulary's size are "off": no top-k work is done for them."""

    def ranked(logp: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
        raise AssertionError(f"top-k ranked rows asking for {list(ks)}")

    monkeypatch.setattr(sampling, "_top_k", ranked)
    logits = torch.randn(3, 100)
    choose_tokens(logits, [1.0, 0.7, 1.0], [1.0, 0.9, 1.0], [None] * 3, top_ks=[0, 100, 2**63])
    with pytest.raises(AssertionError, match=r"\[99\]"):
        choose_tokens(logits, [1.0, 0.7, 1.0], [1.0, 0.9, 1.0], [None] * 3, top_ks=[0, 99, 2**63])


def test_top_k_leaves_the_reported_log_probs_and_alternatives_uncut() -> None:
    """The log-prob of a token drawn under top-k is the tempered policy's, not the renormalised
    one, and the listed alternatives include tokens the cut excluded, as for top-p."""
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs, tops = choose_tokens(LOGITS, [0.5], [1.0], [generator], top_logprobs=[4], top_ks=[1])
    tempered = torch.log_softmax(LOGITS[0] / 0.5, dim=-1)
    assert tokens == [0]
    assert logprobs[0] == pytest.approx(tempered[0].item()) and logprobs[0] < -0.1
    assert [t for t, _ in tops[0]] == [0, 1, 2, 3]
    assert [lp for _, lp in tops[0]] == pytest.approx(tempered.tolist())
