"""One batch of the torch engine's step loop: its rows, their shared KV cache, and joining.

Owns the state of a request from ``generate`` to its result (``Pending``), of an admitted one
while it decodes (``Row``) and of the rows decoding together (``Batch``), and the numerics of
the batch's cache: merging a batch of newcomers into the running one (``merge``: left-pad the
narrower cache and mask with zeros, then concatenate the rows) and dropping finished rows and the
leading columns no row uses any more (``compact``), plus scoring a prompt from its prefill's
logits (``score_prompt``), the error a row gets when the engine fails (``fault``) and the
model's end-of-sequence ids (``eos_ids``). When to admit, prefill and step is
``appliance.engines.torch_steps``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.engines.constraints import Guide
from appliance.engines.sampling import TopLogprobs
from contracts.errors import EngineUnavailable


@dataclass(slots=True, eq=False)
class Pending:
    """A request between ``generate`` and its result."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    enqueued_at: float
    loop: asyncio.AbstractEventLoop
    #: Set by the caller's side on cancellation; the step loop polls it every step.
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True, eq=False)
class Row:
    """Step-loop state of one admitted request."""

    pending: Pending
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    version: int
    started_at: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    #: The grammar the row's text must match (None: unconstrained).
    guide: Guide | None = None
    #: The prompt's scores, when the request asks for them (set by the prefill).
    prompt_logprobs: tuple[float | None, ...] = ()
    prompt_top_logprobs: tuple[TopLogprobs, ...] = ()
    #: None while decoding; then "stop", "length", "cancelled" or "error" (its grammar broke).
    finish: str | None = None
    finished_at: float = 0.0

    @property
    def params(self) -> SamplingParams:
        return self.pending.request.params


@dataclass(slots=True, eq=False)
class Batch:
    """Rows decoding together: their KV cache, mask (rows, width), next positions (rows,) and
    the tokens chosen last, to be fed at the next step (rows,). Every row is unfinished."""

    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor
    next_pos: torch.Tensor
    tokens: torch.Tensor


def eos_ids(*values: Any) -> frozenset[int]:
    """The union of ``eos_token_id`` fields, each None, an int or a list of ints."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def score_prompt(row: Row, logits: torch.Tensor, prompt: list[int]) -> None:
    """Set ``row``'s prompt scores from the prefill's ``logits`` (len(prompt), vocab) at its
    prompt's positions: log p(prompt[j] | prompt[:j]) under the raw model distribution
    (log_softmax of the logits, temperature 1: no temperature, top-p or grammar applies to a
    prompt), with the k most likely tokens at each position; nothing for the first token."""
    k = row.pending.request.prompt_logprobs or 0
    # Position j - 1 predicts token j.
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
    row.prompt_logprobs = (None, *(float(v) for v in chosen))
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = (tuple((int(t), float(v)) for t, v in zip(i, x, strict=True)) for i, x in pairs)
        row.prompt_top_logprobs = ((), *tops)
    else:
        row.prompt_top_logprobs = tuple(() for _ in prompt)


def set_exception(future: asyncio.Future[GenerateResult], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def fault(doing: str, exc: BaseException) -> EngineUnavailable:
    """The retryable error a caller gets when the engine itself failed while ``doing``."""
    error = EngineUnavailable(f"the torch engine failed while {doing} ({type(exc).__name__}: {exc}); retry")
    error.__cause__ = exc
    return error


def _left_pad_columns(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, each with ``keys`` and ``values`` (rows, heads, width, head_dim)."""
    return list(cache.layers)


def merge(a: Batch, b: Batch) -> Batch:
    """One batch of ``a``'s rows then ``b``'s, both left-padded to the wider cache."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    for la, lb in zip(_kv_layers(a.cache), _kv_layers(b.cache), strict=True):
        # (rows, heads, width, head_dim): zero keys/values at masked columns never contribute.
        la.keys = torch.cat([_left_pad_columns(la.keys, width, 2), _left_pad_columns(lb.keys, width, 2)])
        la.values = torch.cat(
            [_left_pad_columns(la.values, width, 2), _left_pad_columns(lb.values, width, 2)]
        )
    return Batch(
        rows=a.rows + b.rows,
        cache=a.cache,
        mask=torch.cat([_left_pad_columns(a.mask, width, 1), _left_pad_columns(b.mask, width, 1)]),
        next_pos=torch.cat([a.next_pos, b.next_pos]),
        tokens=torch.cat([a.tokens, b.tokens]),
    )


def compact(batch: Batch) -> Batch | None:
    """Drop finished rows (and their cache) and leading columns no row uses; None if empty."""
    keep = [j for j, row in enumerate(batch.rows) if row.finish is None]
    if not keep:
        return None
    if len(keep) < len(batch.rows):
        index = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
        batch.cache.batch_select_indices(index)
        batch.rows = [batch.rows[j] for j in keep]
        batch.mask, batch.next_pos, batch.tokens = (
            batch.mask[index],
            batch.next_pos[index],
            batch.tokens[index],
        )
        used = batch.mask.any(dim=0)
        first = int(used.int().argmax())  # the first column some row attends to
        if first > 0:
            batch.mask = batch.mask[:, first:]
            for layer in _kv_layers(batch.cache):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
    return batch
