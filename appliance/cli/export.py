"""``lightning-appliance export``: a run's recorded rollouts as a dataset file.

Owns the command's flags (format, shape, the filters) and its one line; reading the event log
and writing the rows is ``appliance.reporting.export``'s. A request that cannot be done (no run
at ``--data-dir``, a shape and a filter that do not go together, a bad ``--steps``) is refused
before that module, and the trainer's stack its rows need (torch, verl), is imported: in well
under a second, as ``up``'s refusals. Not the model export (the final policy a clean stop of
``up`` writes to ``export_dir``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from appliance.config import load_config, umask_bits
from appliance.reporting.export_request import (
    PURPOSES,
    STATUSES,
    ExportFilter,
    check_request,
    parse_steps,
    purpose_name,
)


def add_parser(sub: Any) -> None:
    """``export`` and its flags."""
    dataset = sub.add_parser(
        "export",
        help="write a run's recorded rollouts as a dataset file (JSONL or Parquet) for SFT or offline RL; "
        "not the model: a clean stop of up exports that to export_dir",
        description="Write a run's recorded rollouts (its event log, read-only: also while it runs, or "
        "a backup) as a dataset: --shape sft, one row per rollout with its OpenAI chat messages and "
        "tools; --shape tokens, one row per trained sample with ids, loss mask, log-probs, versions, "
        "reward and advantage. Not the model export (the final policy a clean stop writes to export_dir).",
    )
    dataset.add_argument(
        "--data-dir", type=Path, default=Path("appliance-data"), help="run directory, or a backup of one"
    )
    dataset.add_argument(
        "--format", choices=("jsonl", "parquet"), default="jsonl", help="file format (default jsonl)"
    )
    dataset.add_argument(
        "--shape",
        choices=("sft", "tokens"),
        default="sft",
        help="sft: one row per rollout, chat messages + tools (default); tokens: one row per trained sample",
    )
    dataset.add_argument("--out", type=Path, required=True, help="the dataset file to write")
    dataset.add_argument(
        "--purpose",
        choices=PURPOSES,
        type=purpose_name,
        action="append",
        help="only rollouts played for this, as the rows' purpose names it (repeatable; default all; "
        "training: train)",
    )
    dataset.add_argument("--min-reward", type=float, help="only rollouts with a reward of at least this")
    dataset.add_argument(
        "--steps",
        metavar="A:B",
        help="only rollouts consumed by training steps A..B, inclusive (A:, :B open): trained by the step, "
        "or played by a validation/evaluation round at that step",
    )
    dataset.add_argument(
        "--status",
        choices=("finished", "failed", "any"),
        default="finished",
        help="rollout status to keep (default finished; failed/any for --shape sft only)",
    )


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance export``: the run's rollouts as a dataset file (``appliance.reporting``)."""
    where = ExportFilter(
        purposes=frozenset(args.purpose) if args.purpose else None,
        min_reward=args.min_reward,
        steps=parse_steps(args.steps) if args.steps is not None else None,
        statuses=STATUSES[args.status],
    )
    check_request(args.data_dir, shape=args.shape, fmt=args.format, where=where)
    umask = umask_bits(load_config(resolved=False).data_umask)  # APPLIANCE_DATA_UMASK
    # Only now: the row builders import the trainer's stack (torch, verl), ~5-15 s.
    from appliance.reporting.export import export_dataset

    report = export_dataset(
        args.data_dir, args.out, shape=args.shape, fmt=args.format, where=where, umask=umask
    )
    print(report.line())
    return 0
