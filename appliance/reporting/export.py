"""``lightning-appliance export``: a run's recorded rollouts as a dataset file (JSONL or Parquet).

Owns the writers and the streaming pass over the log; the two row shapes are
``appliance.reporting.dataset_rows``'s, the request (its names, the filters, its refusals)
``appliance.reporting.export_request``'s, which the command line checks before importing this
module (the row builders load torch and verl). Neither owns the samples (``trainer.samples``), the
advantages (``trainer.advantage``), the staleness mask
(``appliance.training.batch``) nor the rule of which rollouts a step trains
(``store.projections.RunState.trainable``): the rows call them, with the settings the run recorded
in its ``ApplianceStarted``, so a ``tokens`` row is what the trainer was given.

Shapes:

* ``sft``: one row per rollout, the conversation as the harness saw it in OpenAI chat form: the
  last call's request (``messages``, ``tools``), converted from whichever API surface it used,
  then that call's answer as the final assistant message (tool calls parsed as the proxy parsed
  them). OpenAI's fine-tuning JSONL and TRL's ``SFTTrainer`` read ``messages`` and ``tools``;
  the other columns (``rollout_id``, ``task_id``, ``reward``, ...) are metadata. Parquet holds
  ``tools`` as a JSON text (each tool's parameters are a free-form schema).
* ``tokens``: one row per trained sample: ``prompt_ids`` (the tokens before the sample's first
  response) and ``response_ids`` (the rest), with ``loss_mask``, ``logprobs`` and ``versions``
  per response token, the rollout's ``reward`` and ``advantage``, the ``step`` that trained it
  and the ``policy_version`` that step updated.

``step`` (and ``--steps A:B``, both ends inclusive): the training step that consumed the rollout,
i.e. trained it (training rollouts; a failed one is consumed by its group's step without being
trained), or the step the run had reached when the validation round or evaluation that played
it completed. A rollout no step or round consumed yet has none and is left out by ``--steps``.

Status: only ``finished`` rollouts by default (a failed rollout's conversation ends in an error,
not an answer to learn from); ``--status failed|any`` exports them too (``sft`` only: ``tokens``
rows are trained samples, and only finished rollouts with a reward are trained), each failed
row with its ``failure_reason`` (one line, as ``status --failures`` shows it).

Memory: the log is read a page at a time (``store.eventstore.iter_events_sync``, read-only: a live
run's writer is not blocked), folded into a :class:`RunState` whose rollouts are written out and
dropped as soon as a step, a validation round or an evaluation consumes them. What is held is the
rollouts in flight (as in the running appliance) plus one Parquet row group, whatever the log's
length. Rows are written to ``PATH.partial``, renamed to ``PATH`` when complete, with the modes
the run's ``data_umask`` leaves (owner-only by default).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import orjson
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from appliance.reporting.dataset_rows import (
    SFT_SCHEMA,
    TOKENS_SCHEMA,
    Row,
    sft_row,
    token_rows,
    trained_rollouts,
)
from appliance.reporting.export_request import (
    PURPOSES,
    STATUSES,
    ExportFilter,
    check_request,
    parse_steps,
)
from contracts.errors import ApplianceError
from store.events import (
    EvaluationCompleted,
    Event,
    LLMCallCompleted,
    RolloutCreated,
    TrainStepCompleted,
    ValidationCompleted,
)
from store.eventstore import iter_events_sync
from store.projections import RunState

__all__ = ["PURPOSES", "STATUSES", "ExportFilter", "ExportReport", "export_dataset", "parse_steps"]

#: Rows per Parquet row group (what is held before a write).
ROW_GROUP = 512


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What :func:`export_dataset` wrote."""

    path: Path
    shape: str
    format: str
    rows: int
    rollouts: int
    #: Events read: the log up to this position.
    events: int
    #: Rollouts kept by the filters that have no row: no model call, or (``sft``) a request the
    #: OpenAI chat shape cannot hold (a text completion, a ``previous_response_id`` chain).
    skipped: int

    def line(self) -> str:
        skipped = f"; {self.skipped} rollouts without a chat conversation skipped" if self.skipped else ""
        return (
            f"exported {self.rows} {self.shape} rows ({self.rollouts} rollouts) from {self.events} events"
            f" to {self.path} ({self.format}){skipped}"
        )


# --- writers ---------------------------------------------------------------------------------------


class _Writer(Protocol):
    def write(self, row: Row) -> None: ...
    def close(self) -> None: ...


class _JsonlWriter:
    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def write(self, row: Row) -> None:
        self.file.write(orjson.dumps(row) + b"\n")

    def close(self) -> None:
        self.file.flush()


class _ParquetWriter:
    """Rows buffered into row groups of ``ROW_GROUP`` rows, each written as it fills."""

    def __init__(self, file: IO[bytes], schema: pa.Schema, row_group: int) -> None:
        self.schema, self.row_group = schema, row_group
        self.writer = pq.ParquetWriter(file, schema)
        self.rows: list[Row] = []

    def write(self, row: Row) -> None:
        if self.schema is SFT_SCHEMA:
            row = {**row, "tools": json.dumps(row["tools"], ensure_ascii=False)}
        self.rows.append(row)
        if len(self.rows) >= self.row_group:
            self._flush()

    def _flush(self) -> None:
        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def close(self) -> None:
        self._flush()
        self.writer.close()


# --- the pass over the log -------------------------------------------------------------------------


class _Export:
    """The fold: events in, rows out, consumed rollouts dropped."""

    def __init__(self, shape: str, where: ExportFilter, writer: _Writer) -> None:
        self.shape, self.where, self.writer = shape, where, writer
        self.state = RunState()
        self.rows = self.rollouts = self.skipped = 0

    def apply(self, event: Event, position: int) -> None:
        state = self.state
        consumed: Sequence[str] = ()
        if isinstance(event, TrainStepCompleted):
            consumed = event.rollouts
            if self.shape == "tokens":
                self._trained(event)
            else:
                self._conversations(consumed, event.step)
        elif isinstance(event, ValidationCompleted | EvaluationCompleted):
            consumed = event.rollouts
            if self.shape == "sft":
                self._conversations(consumed, event.step)
        elif (
            self.shape == "tokens"
            and isinstance(event, RolloutCreated | LLMCallCompleted)
            and (event.purpose if isinstance(event, RolloutCreated) else self._purpose(event.rollout))
            != "train"
        ):
            return  # never trained: not a tokens row
        state.apply(event, position)
        for rollout in consumed:
            state.rollouts.pop(rollout, None)
        # The export reads none of these, and the fold would keep one per step or round.
        state.steps.clear()
        state.validations.clear()
        state.evaluations.clear()

    def _purpose(self, rollout: str) -> str:
        view = self.state.rollouts.get(rollout)
        return view.purpose if view is not None else ""

    def finish(self) -> None:
        """Rollouts no step or round consumed (``sft`` only: ``tokens`` rows are trained ones)."""
        if self.shape == "sft":
            self._conversations(list(self.state.rollouts), None)

    def _conversations(self, rollouts: Sequence[str], step: int | None) -> None:
        for rollout in rollouts:
            view = self.state.rollouts.get(rollout)
            if view is None or not self.where.keeps(view, step):
                continue
            row = sft_row(view, step)
            if row is None:
                self.skipped += 1
                continue
            self.writer.write(row)
            self.rows += 1
            self.rollouts += 1

    def _trained(self, step: TrainStepCompleted) -> None:
        version = self.state.policy_version
        for trained in trained_rollouts(self.state, step):
            if not self.where.keeps(trained.view, step.step):
                continue
            self.rollouts += 1
            for row in token_rows(trained, step.step, version):
                self.writer.write(row)
                self.rows += 1


def export_dataset(
    data_dir: Path,
    out: Path,
    *,
    shape: str,
    fmt: str,
    where: ExportFilter | None = None,
    umask: int = 0o077,
    page: int = 512,
    row_group: int = ROW_GROUP,
) -> ExportReport:
    """Write the rollouts of the run at ``data_dir`` (a live one, read-only, or a backup) kept by
    ``where`` to ``out`` as ``shape`` rows in ``fmt``; the file gets the modes ``umask`` leaves."""
    where = where or ExportFilter()
    source = check_request(data_dir, shape=shape, fmt=fmt, where=where)
    partial = out.with_name(out.name + ".partial")
    previous = os.umask(umask)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 & ~umask)
        os.fchmod(fd, 0o666 & ~umask)  # an earlier partial file keeps its modes otherwise
        with os.fdopen(fd, "wb") as file:
            writer: _Writer = (
                _JsonlWriter(file)
                if fmt == "jsonl"
                else _ParquetWriter(file, SFT_SCHEMA if shape == "sft" else TOKENS_SCHEMA, row_group)
            )
            export = _Export(shape, where, writer)
            events = 0
            for stored in iter_events_sync(source, page=page):
                export.apply(stored.event, stored.position)
                events = stored.position
            export.finish()
            writer.close()
        partial.replace(out)
    except OSError as exc:
        where_ = f" ({exc.filename})" if exc.filename else ""
        raise ApplianceError(f"could not export to {out}: {exc.strerror or exc}{where_}") from None
    finally:
        os.umask(previous)
        partial.unlink(missing_ok=True)
    return ExportReport(out, shape, fmt, export.rows, export.rollouts, events, export.skipped)
