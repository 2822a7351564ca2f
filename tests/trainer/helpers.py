"""Helpers shared by the trainer tests: on-policy samples scored by a model itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.samples import NOT_SAMPLED, Sample

PROMPT = [5, 6, 7]


def teacher_forced(model: Any, tokens: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log p(tokens[t] | tokens[:t]) for t >= 1 (0.0 at t = 0), one unpadded forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(tokens)])).logits[0] / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1)
    picked = logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def sample(
    model: Any, rollout: str, response: Sequence[int], *, shift: float = 0.0, temperature: float = 1.0
) -> Sample:
    """An on-policy sample: its recorded logprobs are the model's own (minus ``shift``)."""
    tokens = [*PROMPT, *response]
    mask = [0] * len(PROMPT) + [1] * len(response)
    lps = teacher_forced(model, tokens, temperature)
    return Sample(
        rollout=rollout,
        call_ids=(f"{rollout}-call",),
        tokens=tuple(tokens),
        loss_mask=tuple(mask),
        logprobs=tuple(lp - shift if m else 0.0 for lp, m in zip(lps, mask, strict=True)),
        versions=tuple(0 if m else NOT_SAMPLED for m in mask),
    )


def sampled_logprob(model: Any, response: Sequence[int]) -> float:
    """Total log-prob of ``response`` after ``PROMPT`` under ``model``."""
    return sum(teacher_forced(model, [*PROMPT, *response])[len(PROMPT) :])
