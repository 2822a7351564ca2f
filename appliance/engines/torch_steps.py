"""The torch engine's step loop: admission, prefill and decode steps on one worker thread.

Owns what ``TorchEngine`` runs while anything is queued or running: ``_serve`` starts the loop
(``_run``) in a worker thread whenever requests wait and nothing holds the engine; each turn
admits queued requests as rows (up to ``max_batch_size``; one that cannot be made a row fails
alone), prefills them as their own left-padded batch (retried one by one if it raises), merges
them into the running batch, and advances every row by one token (``appliance.engines.sampling``
chooses it), delivering each result on its caller's event loop the moment its row ends. The
batch's cache numerics are ``appliance.engines.torch_batch``'s; the queue, the lock and the
weights the loop runs on are set up by ``appliance.engines.torch_engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from appliance.engines.base import MIN_TOP_P, SEED_MAX, SEED_MIN, GenerateResult
from appliance.engines.constraints import PARAM, GrammarCompiler, mask_logits
from appliance.engines.sampling import choose_tokens
from appliance.engines.served import ServedState
from appliance.engines.torch_batch import (
    Batch,
    Pending,
    Row,
    compact,
    fault,
    merge,
    score_prompt,
    set_exception,
)
from contracts.errors import ApplianceError, BadRequest, EngineUnavailable

log = logging.getLogger(__name__)


class TorchStepLoop(ServedState):
    """``TorchEngine``'s step loop and the admission it makes (a part of the engine, not an
    engine: the fields below are ``TorchEngine``'s, set when it is made and loaded)."""

    _model: Any
    _device: torch.device
    _model_dir: Path
    _max_batch_size: int
    _vocab_size: int
    _pad_id: int
    _eos_ids: frozenset[int]
    _joinable: bool
    _inbox: deque[Pending]
    _wakeup: asyncio.Event
    _lock: asyncio.Lock
    _exclusive: int
    _stopping: threading.Event
    _running: list[Row]
    _work: asyncio.Future[None] | None
    _grammars: GrammarCompiler | None

    async def _serve(self) -> None:
        """Start the step loop whenever requests are queued and nothing holds the engine."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._inbox or self._exclusive or self._released:
                continue
            async with self._lock:
                self._work = asyncio.ensure_future(asyncio.to_thread(self._run))
                try:
                    # ``_run`` fails its own rows on any error, so the engine serves on.
                    await asyncio.shield(self._work)
                finally:
                    self._running = []
            if self._inbox:
                self._wakeup.set()  # left behind by a drain; admitted once it is over

    def _admitting(self) -> bool:
        return self._exclusive == 0 and not self._stopping.is_set()

    def _run(self) -> None:
        """The step loop (worker thread): admit, prefill and merge newcomers, step; repeat
        until nothing runs and nothing may be admitted.

        Every row it admits ends with its result or an error delivered: a decode step (or a
        merge) that raises fails every running row, and the loop returns, to be started afresh
        by ``_serve`` for whatever is queued; a loop stopped by ``close`` fails what still runs.
        """
        try:
            with torch.inference_mode():
                self._steps()
        except Exception as exc:
            log.exception("torch engine: a decode step failed with %d rows; they fail", len(self._running))
            self._fail_running(fault("generating", exc))
        finally:
            self._fail_running(EngineUnavailable("the torch engine was closed"))

    def _steps(self) -> None:
        """The loop itself; ``_running`` always holds every row admitted and not yet finished."""
        batch: Batch | None = None
        while not self._stopping.is_set():
            running = batch.rows if batch is not None else []
            if batch is None or self._joinable:
                newcomers = self._admit(self._max_batch_size - len(running))
                if newcomers:
                    self._running = running + newcomers
                    fresh = self._prefill_isolated(newcomers)
                    self._running = running + (fresh.rows if fresh is not None else [])
                    if fresh is not None:
                        batch = fresh if batch is None else merge(batch, fresh)
            if batch is None:
                self._running = []
                if self._inbox and self._admitting():
                    continue
                return
            batch = self._step(batch)
            self._running = batch.rows if batch is not None else []

    def _fail_running(self, error: Exception) -> None:
        """Fail every row still running (those already delivered are left alone)."""
        rows, self._running = self._running, []
        for row in rows:
            self._fail(row.pending, error)

    @staticmethod
    def _fail(pending: Pending, error: Exception) -> None:
        """Deliver ``error`` to ``pending``'s caller from the worker thread, after any result
        or token already queued for it (so a delivered result is never overwritten)."""
        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits any more
            pending.loop.call_soon_threadsafe(set_exception, pending.future, error)

    def _admit(self, room: int) -> list[Row]:
        """Up to ``room`` queued requests as rows; one that cannot be made a row fails alone."""
        rows: list[Row] = []
        while len(rows) < room and self._inbox and self._admitting():
            pending = self._inbox.popleft()
            if not pending.cancelled.is_set() and (row := self._row_or_fail(pending)) is not None:
                rows.append(row)
        return rows

    def _row_or_fail(self, pending: Pending) -> Row | None:
        try:
            return self._new_row(pending)
        except ApplianceError as exc:
            log.warning("torch engine: a request passed validation but was refused: %s", exc.message)
            self._fail(pending, exc)
        except Exception as exc:
            log.exception("torch engine: admitting a request failed")
            self._fail(pending, fault("admitting the request", exc))
        return None

    def _new_row(self, pending: Pending) -> Row:
        params = pending.request.params
        generator = None
        if params.seed is not None:
            # A private stream per request: the same seed gives the same sample whatever else
            # shares the batch. Unseeded rows draw from torch's global generator.
            generator = torch.Generator(device=self._device)
            try:
                generator.manual_seed(params.seed)
            except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
                raise BadRequest(
                    f"seed {params.seed!r} cannot seed a generator ({exc}); "
                    f"use an integer in [{SEED_MIN}, {SEED_MAX}]",
                    param="seed",
                ) from exc
        stop_ids = frozenset(params.stop_token_ids) or self._eos_ids
        guide = None
        if params.constraint is not None:
            guide = self._grammar_compiler().guide(params.constraint, stop_ids)
        return Row(pending, stop_ids, generator, self._policy_version, time.monotonic(), guide=guide)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            path = self._model_dir / "tokenizer.json"
            if not path.is_file():
                raise BadRequest(
                    f"constraints need the model's tokenizer.json, and {path} is missing", param=PARAM
                )
            self._grammars = GrammarCompiler(
                path.read_text(), self._vocab_size, min(self._eos_ids, default=self._pad_id)
            )
        return self._grammars

    def _prefill_isolated(self, rows: list[Row]) -> Batch | None:
        """``_prefill`` of ``rows``; if it raises, each row again on its own, so only a request
        that fails alone fails and the others start as they would have."""
        try:
            return self._prefill(rows)
        except Exception as exc:
            if len(rows) == 1:
                self._fail_prefill(rows[0], exc)
                return None
            error = exc
        log.warning(
            "torch engine: prefilling %d requests together failed (%s: %s); trying them one by one",
            len(rows),
            type(error).__name__,
            error,
        )
        fresh: Batch | None = None
        for row in rows:
            if row.finish is not None or row.pending.cancelled.is_set():
                continue  # delivered, or nobody waits for it
            if row.token_ids:  # its stream has tokens already: it cannot start over
                self._fail(row.pending, fault("prefilling the request", error))
                continue
            # A new row (a fresh generator): a seeded request draws what it would draw alone.
            retry = self._row_or_fail(row.pending)
            if retry is None:
                continue
            try:
                single = self._prefill([retry])
            except Exception as exc:
                self._fail_prefill(retry, exc)
                continue
            if single is not None:
                fresh = single if fresh is None else merge(fresh, single)
        return fresh

    def _fail_prefill(self, row: Row, exc: Exception) -> None:
        if isinstance(exc, ApplianceError):
            self._fail(row.pending, exc)
            return
        log.error(
            "torch engine: prefilling a request of %d tokens failed",
            len(row.pending.request.prompt_ids),
            exc_info=exc,
        )
        self._fail(row.pending, fault("prefilling the request", exc))

    def _prefill(self, rows: list[Row]) -> Batch | None:
        """Run the prompts of ``rows`` as one left-padded batch and choose their first tokens."""
        device, model = self._device, self._model
        prompts = [list(r.pending.request.prompt_ids) for r in rows]
        width = max(len(p) for p in prompts)
        # Left padding: every row's last prompt token sits in the last column, so one forward
        # gives each row's next-token logits at position -1 and new tokens append in lockstep.
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        # Positions count real tokens only, so a padded row sees exactly the positions (and
        # hence rotary phases) it would see alone; pads get 0 and are masked anyway.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
        cache = DynamicCache(config=model.config)
        scored = [i for i, r in enumerate(rows) if r.pending.request.prompt_logprobs is not None]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            # Scoring prompts needs the logits at every position (rows x width x vocab);
            # otherwise only the last one is computed.
            logits_to_keep=0 if scored else 1,
        )
        for i in scored:
            score_prompt(rows[i], out.logits[i, width - len(prompts[i]) :], prompts[i])
        tokens = self._advance(out.logits[:, -1, :], rows)
        return compact(Batch(rows, cache, mask, next_pos, tokens))

    def _step(self, batch: Batch) -> Batch | None:
        """Feed every row its last token, choose the next one, drop the rows that ended."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        out = self._model(
            input_ids=batch.tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.next_pos[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.next_pos = batch.next_pos + 1
        batch.tokens = self._advance(out.logits[:, -1, :], batch.rows)
        return compact(batch)

    def _advance(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Choose each row's next token, record it with its log-prob, finish and deliver rows
        that end. Returns the chosen ids (rows,) on the logits' device, to feed the next step."""
        params = [r.params for r in rows]
        # Constrained rows sample from the policy restricted to what their grammar allows.
        logits = mask_logits(logits, [r.guide for r in rows])
        tokens, logprobs, tops = choose_tokens(
            logits,
            [p.temperature for p in params],
            [max(p.top_p, MIN_TOP_P) for p in params],
            [r.generator for r in rows],
            top_logprobs=[p.top_logprobs for p in params],
            top_ks=[p.top_k for p in params],
        )
        now = time.monotonic()
        for row, token, logprob, top in zip(rows, tokens, logprobs, tops, strict=True):
            if row.pending.cancelled.is_set():
                row.finish = "cancelled"
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if row.guide is not None:
                row.guide.consume(token)
                if row.guide.error is not None:
                    # The grammar broke while sampling: an answer past this point would not
                    # hold to the constraint, so the request fails instead (``_deliver``).
                    row.finish, row.finished_at = "error", now
                    row.pending.loop.call_soon_threadsafe(self._deliver, row)
                    continue
            if top:
                row.top_logprobs.append(top)
            on_token = row.pending.request.on_token
            if on_token is not None:
                row.pending.loop.call_soon_threadsafe(on_token, token, logprob)
            if token in row.stop_ids:
                row.finish, row.finished_at = "stop", now
            elif len(row.token_ids) >= row.params.max_tokens:
                row.finish, row.finished_at = "length", now
            if row.finish is not None:
                # Queued behind this row's on_token calls, so a stream sees every token first.
                row.pending.loop.call_soon_threadsafe(self._deliver, row)
        return torch.tensor(tokens, dtype=torch.long, device=logits.device)

    @staticmethod
    def _deliver(row: Row) -> None:
        future = row.pending.future
        if future.done() or row.finish is None:
            return
        if row.finish == "error" and row.guide is not None:
            future.set_exception(
                BadRequest(
                    f"the output constraint cannot be enforced on this request: {row.guide.error}; "
                    "simplify the schema or grammar"
                )
            )
            return
        future.set_result(
            GenerateResult(
                token_ids=tuple(row.token_ids),
                logprobs=tuple(row.logprobs),
                finish_reason=row.finish,
                policy_version=row.version,
                queue_s=row.started_at - row.pending.enqueued_at,
                gen_s=row.finished_at - row.started_at,
                top_logprobs=tuple(row.top_logprobs),
                prompt_logprobs=row.prompt_logprobs,
                prompt_top_logprobs=row.prompt_top_logprobs,
            )
        )
