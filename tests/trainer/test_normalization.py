"""Loss normalization: per-token weights by hand, and the torch backend's gradients under each mode."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import sample
from trainer.items import TrainItem
from trainer.normalization import NORMALIZATIONS, check_normalization, sample_weights
from trainer.policy import PolicyTrainer
from trainer.samples import Sample


def trained(rollout: str, n: int) -> Sample:
    """A sample with a 2-token prompt and ``n`` sampled tokens (all trainable)."""
    tokens = tuple(range(2 + n))
    mask = (0, 0) + (1,) * n
    return Sample(rollout, (rollout,), tokens, mask, (0.0,) * len(tokens), (-1, -1) + (0,) * n)


# Rollout A: samples of 1, 2 and 4 trainable tokens (N_A = 7); B: one of 5 (N_B = 5); C: nothing
# trainable (its only sampled token is at position 0, which nothing predicts). T = 12 tokens,
# S = 4 samples and R = 2 rollouts with something to train.
A = [trained("A", 1), trained("A", 2), trained("A", 4)]
B = [trained("B", 5)]
C = [Sample("C", ("c",), (7, 8), (1, 0), (-0.1, 0.0), (0, -1))]


def flat(weights: list[list[float]]) -> list[float]:
    assert [len(row) for row in weights] == [3, 1, 1]
    return [w for row in weights for w in row]


def test_rollout_mode_weighs_every_rollout_the_same() -> None:
    # 1 / (R * N_r): A 1/(2*7), B 1/(2*5).
    assert flat(sample_weights([A, B, C], "rollout")) == pytest.approx([1 / 14] * 3 + [1 / 10, 0.0])


def test_sample_mode_weighs_every_sample_the_same() -> None:
    # 1 / (S * N_s) with S = 4.
    assert flat(sample_weights([A, B, C], "sample")) == pytest.approx([1 / 4, 1 / 8, 1 / 16, 1 / 20, 0.0])


def test_token_mode_weighs_every_token_the_same() -> None:
    assert flat(sample_weights([A, B, C], "token")) == pytest.approx([1 / 12] * 4 + [0.0])


@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_weights_sum_to_one_over_the_trained_tokens(mode: str) -> None:
    weights = sample_weights([A, B, C], check_normalization(mode))
    counts = [[1, 2, 4], [5], [0]]
    total = sum(w * n for wr, nr in zip(weights, counts, strict=True) for w, n in zip(wr, nr, strict=True))
    assert total == pytest.approx(1.0)


def test_default_is_rollout_and_degenerate_steps() -> None:
    assert sample_weights([A, B]) == sample_weights([A, B], "rollout")
    assert sample_weights([C, []]) == [[0.0], []]
    assert sample_weights([]) == []
    with pytest.raises(ValueError, match="unknown normalization 'batch'; use one of rollout, sample, token"):
        sample_weights([A], "batch")  # type: ignore[arg-type]


# --- the torch backend's gradient under each mode, against a hand-written loss --------------------


def per_sample_losses(
    model: torch.nn.Module, samples: Sequence[Sample], advantage: float
) -> list[torch.Tensor]:
    """On-policy PPO per-token losses ``-A * exp(logp - old)``, one tensor per sample, unpadded."""
    out = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.tokens])).logits[0, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        out.append((-advantage * torch.exp(logp - torch.tensor(s.logprobs[1:])))[mask])
    return out


@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_torch_backend_gradient_matches_the_mode(tiny_model_dir: Path, mode: str) -> None:
    trainer = PolicyTrainer(tiny_model_dir, normalization=check_normalization(mode))
    model = trainer.model
    a = (sample(model, "A", [10]), sample(model, "A", [11, 12]), sample(model, "A", [13, 14, 15, 16]))
    b = (sample(model, "B", [20, 21, 22, 23, 24]),)
    totals = trainer.backward([TrainItem("A", 1.0, a), TrainItem("B", -0.5, b)])
    got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

    la, lb = per_sample_losses(model, a, 1.0), per_sample_losses(model, b, -0.5)
    if mode == "rollout":
        expected_loss = (torch.cat(la).mean() + torch.cat(lb).mean()) / 2
    elif mode == "sample":
        expected_loss = torch.stack([x.mean() for x in la + lb]).mean()
    else:
        expected_loss = torch.cat(la + lb).mean()
    assert totals.loss == pytest.approx(expected_loss.item(), abs=1e-5)
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-4)
