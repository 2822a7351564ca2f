"""``lightning-appliance export``: a run's recorded rollouts as a dataset file.

Owns the command's flags (format, shape, the filters) and its one line; reading the event log
and writing the rows is ``appliance.reporting.export``'s. Not the model export (the final
policy a clean stop of ``up`` writes to ``export_dir``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from appliance.config import load_config, umask_bits


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
        choices=("training", "validation", "evaluation"),
        action="append",
        help="only rollouts played for this (repeatable; default all)",
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
    from appliance.reporting.export import (
        PURPOSES,
        STATUSES,
        ExportFilter,
        export_dataset,
        parse_steps,
    )

    where = ExportFilter(
        purposes=frozenset(PURPOSES[p] for p in args.purpose) if args.purpose else None,
        min_reward=args.min_reward,
        steps=parse_steps(args.steps) if args.steps is not None else None,
        statuses=STATUSES[args.status],
    )
    umask = umask_bits(load_config(resolved=False).data_umask)  # APPLIANCE_DATA_UMASK
    report = export_dataset(
        args.data_dir, args.out, shape=args.shape, fmt=args.format, where=where, umask=umask
    )
    print(report.line())
    return 0
