"""What a dataset export is asked for, and whether it can be done, decided before anything heavy
loads.

Owns the names the export takes (shapes, formats, purposes, statuses), the filter
(:class:`ExportFilter`), reading ``--steps`` and :func:`check_request`, the refusals a person can
act on (a shape and a filter that cannot go together, no run at the directory). It imports only
``store`` and ``contracts``: ``lightning-appliance export`` refuses a bad request in well under a
second, before the row builders (``appliance.reporting.dataset_rows``, which load the trainer's
stack: torch, verl) and the Parquet writer are imported. It does not own the pass over the log
nor the rows (``appliance.reporting.export``).

A purpose has one name, the one ``RolloutCreated.purpose`` and the rows carry: ``train``,
``validation``, ``evaluation``; ``training`` is taken as ``train`` (its earlier spelling).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from contracts.errors import ApplianceError
from store.projections import RolloutView

Shape = Literal["sft", "tokens"]
Format = Literal["jsonl", "parquet"]
SHAPES: tuple[str, ...] = get_args(Shape)
FORMATS: tuple[str, ...] = get_args(Format)
#: What ``--purpose`` takes: the ``RolloutCreated.purpose`` values, as the rows carry them.
PURPOSES = ("train", "validation", "evaluation")
#: Earlier spellings of a purpose, still accepted: -> its name.
PURPOSE_ALIASES = {"training": "train"}
#: ``--status`` names -> the rollout statuses they keep.
STATUSES = {"finished": ("finished",), "failed": ("failed",), "any": ("finished", "failed", "running")}
#: The run's event log in its data directory.
EVENTS = "events.sqlite"


def purpose_name(text: str) -> str:
    """``text`` as a purpose's one name (``training`` -> ``train``); anything else as it is."""
    return PURPOSE_ALIASES.get(text, text)


@dataclass(frozen=True, slots=True)
class ExportFilter:
    """Which rollouts are exported (every condition must hold)."""

    #: ``RolloutCreated.purpose`` values kept (None: all).
    purposes: frozenset[str] | None = None
    #: Rollouts with a reward of at least this (one without a reward is then left out).
    min_reward: float | None = None
    #: Steps kept, both ends inclusive, either open (see ``appliance.reporting.export``).
    steps: tuple[int | None, int | None] | None = None
    statuses: tuple[str, ...] = ("finished",)

    def keeps(self, view: RolloutView, step: int | None) -> bool:
        if self.purposes is not None and view.purpose not in self.purposes:
            return False
        if view.status not in self.statuses:
            return False
        if self.min_reward is not None and (view.reward is None or view.reward < self.min_reward):
            return False
        if self.steps is not None:
            low, high = self.steps
            if step is None or (low is not None and step < low) or (high is not None and step > high):
                return False
        return True


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"``, ``"A:"``, ``":B"`` or ``"A"`` as inclusive bounds; ``ApplianceError`` otherwise."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low) if low.strip() else None, int(high) if high.strip() else None)
    except ValueError:
        raise ApplianceError(f"--steps takes A:B, A: or :B (training steps); got {text!r}") from None
    if not sep:
        bounds = (bounds[0], bounds[0])
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise ApplianceError(f"--steps {text!r} is empty: {bounds[0]} > {bounds[1]}")
    return bounds


def check_request(data_dir: Path, *, shape: str, fmt: str, where: ExportFilter) -> Path:
    """The event log an export of ``data_dir`` as ``shape`` rows in ``fmt`` filtered by ``where``
    reads; an ``ApplianceError`` of one line when the request cannot be done."""
    if shape not in SHAPES:
        raise ApplianceError(f"--shape must be one of {', '.join(SHAPES)}; got {shape!r}")
    if fmt not in FORMATS:
        raise ApplianceError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if shape == "tokens" and where.statuses != ("finished",):
        raise ApplianceError(
            "--shape tokens holds trained samples, all from finished rollouts: drop --status"
        )
    if shape == "tokens" and where.purposes is not None and "train" not in where.purposes:
        raise ApplianceError(
            "--shape tokens holds trained samples; validation and evaluation rollouts are never trained"
            " (use --shape sft)"
        )
    source = data_dir / EVENTS
    if not source.is_file():
        raise ApplianceError(f"no run at {data_dir} (no {EVENTS}); pass --data-dir DIR")
    return source
