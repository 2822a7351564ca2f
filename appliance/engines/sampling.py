"""Choosing next tokens from logits, and the log-probabilities reported for them.

Owns the numerics of sampling for the in-process engine: temperature, top-k and top-p (nucleus)
filtering, seeded per-row generators and, above all, which log-probability a sampled token
carries. It knows nothing about batching, KV caches, requests or stopping.

A sampled row draws from softmax(logits / T) cut to its ``top_k`` most likely tokens (0: no
cut; tokens tied with the k-th stay too, as in vLLM and Hugging Face), renormalised, then cut to
the top-p nucleus of that renormalised distribution and renormalised again: vLLM's and Hugging
Face's order. A top-k of 1 is therefore greedy (unless two tokens tie for the most likely),
whatever the temperature and top-p.

The reported log-prob is log_softmax(logits / T) at the chosen token, over the *unfiltered*
vocabulary: the tempered policy itself. Top-k and top-p shape which token is drawn but not the
number reported (nor the top log-probs listed), so a trainer's teacher-forced pass (which knows
T but neither top_k nor top_p) reproduces it exactly. Greedy rows (T = 0) take the argmax and
report log_softmax(logits), i.e. T = 1. Logits the caller set to -inf (a grammar's mask) are
simply impossible tokens: the distribution is the policy renormalised over the rest, top-k
ranks the rest only (a row with fewer than k of them keeps them all; a cut never brings a
masked token back), and they are never listed among the top log-probs.

Cost: everything is batched over (rows, vocab) except one uniform number drawn per row from
the row's own generator (so a seeded row's tokens do not depend on its neighbours). A draw is
an inverse-CDF lookup (cumsum + searchsorted) rather than one ``torch.multinomial`` per row
(~1.3 ms per row on a 49k vocabulary, one CPU thread). Nucleus rows look for their nucleus among
their ``NUCLEUS_CANDIDATES`` most likely tokens (one batched ``topk``), widening the window and
sorting the whole vocabulary only when it does not reach ``top_p``: a full sort costs ~4 ms per
row per step on a 49k vocabulary, about as much as a small model's forward pass. Top-k costs one
batched ``topk`` over the rows that ask for it; rows without it skip it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The most likely tokens at one position, as (token id, log-prob), most likely first.
TopLogprobs = tuple[tuple[int, float], ...]

#: Tokens examined for a top-p nucleus before falling back to sorting the whole vocabulary.
NUCLEUS_CANDIDATES = 256
#: Tokens per block of the two-level inverse-CDF search.
_BLOCK = 256


def choose_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    top_logprobs: Sequence[int] | None = None,
    top_ks: Sequence[int] | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs]]:
    """Pick one token per row of ``logits`` (rows, vocab); return the ids, their log-probs, and
    for each row the ``top_logprobs[i]`` most likely ids with their log-probs (empty when 0).

    Row ``i`` is greedy when ``temperatures[i] == 0``; otherwise it samples at that temperature
    from its ``top_ks[i]`` most likely tokens (0, at least the vocabulary's size, or no
    ``top_ks``: all of them), cut to their top-``top_ps[i]`` nucleus, with ``generators[i]``
    (None: torch's global generator). Log-probs, the chosen token's and the listed ones, are of
    the tempered distribution before the top-k and top-p cuts (see the module docstring).
    """
    logits = logits.float()
    rows = logits.shape[0]
    # Greedy rows use T = 1 for the log-prob they report; dividing by 1 changes nothing.
    scales = [t or 1.0 for t in temperatures]
    if any(t != 1.0 for t in scales):
        logits_t = logits / torch.tensor(scales, dtype=logits.dtype, device=logits.device)[:, None]
    else:
        logits_t = logits
    # log_softmax subtracts the row max before exponentiating: stable for any T > 0.
    logp = torch.log_softmax(logits_t, dim=-1)
    picks = torch.empty(rows, dtype=torch.long, device=logits.device)
    greedy = [i for i, t in enumerate(temperatures) if t <= 0]
    if greedy:
        # The argmax is among any top-k: a greedy row's top_k changes nothing.
        picks[greedy] = _rows(logits, greedy).argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if sampled:
        picks[sampled] = draw_rows(
            _rows(logp, sampled),
            [top_ps[i] for i in sampled],
            [generators[i] for i in sampled],
            None if top_ks is None else [top_ks[i] for i in sampled],
        )
    chosen = logp.gather(1, picks[:, None]).squeeze(1)
    tops: list[TopLogprobs] = [() for _ in temperatures]
    k = max(top_logprobs or [0])
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        for i, row_k in enumerate(top_logprobs or []):
            pairs = zip(ids[i, :row_k].tolist(), values[i, :row_k].tolist(), strict=True)
            # Tokens masked to -inf (a grammar forbids them) cannot be drawn: not alternatives.
            tops[i] = tuple((int(t), float(v)) for t, v in pairs if v != float("-inf"))
    # One device-to-host copy for the whole batch.
    return picks.tolist(), chosen.tolist(), tops


def _rows(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``t[index]``, without the copy when ``index`` is every row in order."""
    return t if index == list(range(t.shape[0])) else t[index]


def draw_rows(
    logp: torch.Tensor,
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    top_ks: Sequence[int] | None = None,
) -> torch.Tensor:
    """Sample one id per row of ``logp`` (rows, vocab) from exp(logp) cut to its ``top_ks[j]``
    most likely tokens (0, at least ``vocab``, or no ``top_ks``: no cut) and then to the top-p
    nucleus of what is left, renormalised.

    Returns the ids (rows,) on ``logp``'s device.
    """
    probs = logp.exp()
    rows, vocab = probs.shape
    # One uniform per row from the row's own stream: a seeded row's draw never depends on its
    # neighbours, and the rest of the draw is batched.
    uniforms = torch.stack(
        [torch.rand((), dtype=torch.float64, device=probs.device, generator=g) for g in generators]
    )
    ks = top_ks or ()
    cut = [j for j, k in enumerate(ks) if 0 < k < vocab]
    # Each row's mass after its top-k cut, when some row has one: its nucleus is top_p of that.
    masses: torch.Tensor | None = None
    if cut:
        kept = _rows(probs, cut).masked_fill(~_top_k(_rows(logp, cut), [ks[j] for j in cut]), 0.0)
        probs[cut] = kept  # probs is this call's own tensor
        masses = torch.ones(rows, dtype=probs.dtype, device=probs.device)
        masses[cut] = kept.sum(dim=-1)
    picks = torch.empty(rows, dtype=torch.long, device=probs.device)
    whole = [j for j, p in enumerate(top_ps) if p >= 1.0]
    if whole:
        picks[whole] = _inverse_cdf(_rows(probs, whole), uniforms[whole])
    pending = [j for j, p in enumerate(top_ps) if p < 1.0]
    for k in _windows(vocab):
        if not pending:
            break
        # topk gives each row's k most likely tokens, most likely first: the head of the order a
        # full sort gives (k == vocab is the full sort), so the nucleus is the one it would find.
        top_probs, top_ids = probs[pending].topk(k, dim=-1)
        limit = torch.tensor([top_ps[j] for j in pending], dtype=probs.dtype, device=probs.device)
        if masses is not None:
            limit = limit * masses[pending]
        # The nucleus ends inside the window iff the window's mass reaches its limit: then the
        # mass before token k + 1 is at least the limit and it, and all after it, are cut.
        complete = [True] * len(pending) if k == vocab else (top_probs.sum(dim=-1) >= limit).tolist()
        done = [r for r, ok in enumerate(complete) if ok]
        if done:
            chosen = _inverse_cdf(
                _nucleus(top_probs[done], limit[done, None]), uniforms[[pending[r] for r in done]]
            )
            picks[[pending[r] for r in done]] = top_ids[done].gather(1, chosen[:, None]).squeeze(1)
        pending = [j for j, ok in zip(pending, complete, strict=True) if not ok]
    return picks


def draw_top_p(
    logp: torch.Tensor, top_p: float, generator: torch.Generator | None, top_k: int = 0
) -> torch.Tensor:
    """Sample one token id (a 0-d tensor) from exp(logp) (vocab,), cut to its ``top_k`` most
    likely tokens (0: all) and then to the top-p nucleus of those."""
    return draw_rows(logp[None, :], [top_p], [generator], [top_k])[0]


def _top_k(logp: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Which tokens of each row of ``logp`` (rows, vocab) are among its ``ks[i]`` (1 <= k <
    vocab) most likely: those at least as likely as the k-th, so ties with it stay, as in
    vLLM's and Hugging Face's top-k. One ``topk`` up to the largest k serves every row."""
    values = logp.topk(max(ks), dim=-1).values
    index = torch.tensor([k - 1 for k in ks], device=logp.device)[:, None]
    return logp >= values.gather(1, index)


def _nucleus(sorted_probs: torch.Tensor, limit: torch.Tensor | float) -> torch.Tensor:
    """Zero all but the smallest prefix of ``sorted_probs`` (descending along the last dim)
    whose mass reaches ``limit`` (top_p times the mass of the distribution, 1 unless top-k cut
    it): a token stays if the mass strictly before it is below the limit, so the most likely
    one always stays. The draw renormalises what is left."""
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return sorted_probs.masked_fill(before >= limit, 0.0)


def _windows(vocab: int) -> list[int]:
    """Nucleus search windows, widest last; a small vocabulary is sorted whole at once."""
    return [k for k in (NUCLEUS_CANDIDATES, 16 * NUCLEUS_CANDIDATES) if 4 * k <= vocab] + [vocab]


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of ``weights`` (rows, n; unnormalised, >= 0) the index where its running
    sum first exceeds ``uniform * total``: a draw from the categorical distribution they define.

    Running sums are float64 (over 49k float32 terms their rounding error stays below ~1e-11,
    far below any token's probability worth drawing) and two-level: over totals of blocks of
    ``_BLOCK`` tokens, then inside the one block the target falls in. A float64 cumsum over the
    whole row is ~40x slower on CPU than the block totals. A zero weight never starts a rise of
    the running sum, so it is never chosen, except when rounding puts the target at the very end
    (odds ~1e-16): then the last index with weight is taken.
    """
    rows, n = weights.shape
    exact = weights.double()  # one conversion; every sum below is then float64 and consistent
    pad = (-n) % _BLOCK
    blocks = (torch.nn.functional.pad(exact, (0, pad)) if pad else exact).view(rows, -1, _BLOCK)
    cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # (rows, blocks)
    targets = uniforms * cdf[:, -1]
    block = _search(cdf, targets)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inner = blocks[torch.arange(rows, device=weights.device), block].cumsum(dim=-1)
    index = (block * _BLOCK + _search(inner, targets - before)).clamp(max=n - 1)
    empty = weights.gather(1, index[:, None]).squeeze(1) <= 0
    if bool(empty.any()):
        last = n - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)
        index = torch.where(empty, last, index)
    return index


def _search(cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose running sum exceeds the target (the last if none does)."""
    found = torch.searchsorted(cdf, targets[:, None].contiguous(), right=True).squeeze(1)
    return found.clamp(max=cdf.shape[-1] - 1)
