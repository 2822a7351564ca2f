"""Choosing next tokens from logits, and the log-probabilities reported for them.

Owns the numerics of sampling for the in-process engine: temperature, top-p (nucleus)
filtering, seeded per-row generators and, above all, which log-probability a sampled token
carries. It knows nothing about batching, KV caches, requests or stopping.

The reported log-prob is log_softmax(logits / T) at the chosen token, over the *unfiltered*
vocabulary: the tempered policy itself. Top-p shapes which token is drawn but not the number
reported, so a trainer's teacher-forced pass (which knows T but not top_p) reproduces it
exactly. Greedy rows (T = 0) take the argmax and report log_softmax(logits), i.e. T = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The most likely tokens at one position, as (token id, log-prob), most likely first.
TopLogprobs = tuple[tuple[int, float], ...]


def choose_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    top_ks: Sequence[int] | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs]]:
    """Pick one token per row of ``logits`` (rows, vocab); return the ids, their log-probs, and
    for each row the ``top_ks[i]`` most likely ids with their log-probs (empty when 0).

    Row ``i`` is greedy when ``temperatures[i] == 0``; otherwise it samples at that temperature
    from its top-``top_ps[i]`` nucleus with ``generators[i]`` (None: torch's global generator).
    """
    logits = logits.float()
    # Greedy rows use T = 1 for the log-prob they report; dividing by 1 changes nothing.
    scale = torch.tensor([t or 1.0 for t in temperatures], dtype=logits.dtype, device=logits.device)
    # log_softmax subtracts the row max before exponentiating: stable for any T > 0.
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    picks = logits.argmax(dim=-1)
    for i, temperature in enumerate(temperatures):
        if temperature > 0:
            picks[i] = draw_top_p(logp[i], top_ps[i], generators[i])
    chosen = logp.gather(1, picks[:, None]).squeeze(1)
    tops: list[TopLogprobs] = [() for _ in temperatures]
    k = max(top_ks or [0])
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        for i, row_k in enumerate(top_ks or []):
            pairs = zip(ids[i, :row_k].tolist(), values[i, :row_k].tolist(), strict=True)
            tops[i] = tuple((int(t), float(v)) for t, v in pairs)
    # One device-to-host copy for the whole batch.
    return picks.tolist(), chosen.tolist(), tops


def draw_top_p(logp: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one token id (a 0-d tensor) from exp(logp), cut to its top-p nucleus."""
    probs = logp.exp()
    if top_p < 1.0:
        # Keep the smallest prefix of tokens, by probability, whose mass reaches top_p: a token
        # stays if the mass strictly before it is below top_p, so the most likely one always
        # stays. multinomial renormalises what is left, so no division is needed.
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
