"""``lightning-appliance status``: the run in a data directory, summarised from its store.

Owns the summary (``status_report``: phase, policy, how the run's latest start stopped and
why, steps, rollouts by state and why they failed, validation and evaluation rounds (the agent
an evaluation played; "no rollout finished" for a round every rollout of which failed), the
checksum chain, the disk the run takes by part) and its text (or ``--json``). It reads the
store read-only, also while another process is writing it; a broken checksum chain is
reported, not a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance.cli.common import loss_text, reward_text
from appliance.config import recorded_value
from appliance.rollouts.sandboxing import recorded_line
from contracts.errors import ApplianceError


def add_parser(sub: Any) -> None:
    """``status`` and its flags."""
    status = sub.add_parser("status", help="print the state of a run from its store")
    status.add_argument("--data-dir", type=Path, default=Path("appliance-data"))
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.add_argument(
        "--failures",
        type=_count,
        nargs="?",
        const=10,
        metavar="N",
        help="also list the last N failed rollouts (default 10) with rollout id, task and reason",
    )


def _count(text: str) -> int:
    """``--failures N``: a count, 0 or more (argparse turns the error into one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of rollouts, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance status``."""
    summary = status_report(args.data_dir, failures=args.failures or 0)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_status(summary)
    return 0


def status_report(data_dir: Path, failures: int = 0) -> dict[str, Any]:
    """The run in ``data_dir`` summarised for ``status``; with ``failures``, the last that many
    failed rollouts too (``failures``: rollout, task, purpose and reason)."""
    from store.eventstore import iter_events_sync
    from store.outcomes import grouped_reasons, reason_of, state_counts, state_of
    from store.projections import RunState
    from store.token_figures import step_tokens

    db = data_dir / "events.sqlite"
    if not db.is_file():
        raise ApplianceError(f"no run at {data_dir} (no {db.name}); start one with: lightning-appliance up")
    state = RunState.from_events(iter_events_sync(db))
    summary = state.summary()
    # Every view names a rollout's state the same way (an unclaimed external one is "offered").
    summary["rollouts"] = state_counts(state.rollouts.values())
    failed = [view for view in state.rollouts.values() if state_of(view) == "failed"]
    summary["failure_reasons"] = [
        {"reason": reason, "count": count} for reason, count in grouped_reasons(failed)
    ]
    if failures > 0:
        summary["failures"] = [
            {"rollout": v.rollout, "task_id": v.task_id, "purpose": v.purpose, "reason": reason_of(v)}
            for v in failed[-failures:]
        ]
    summary["steps_detail"] = [
        {
            "step": s.step,
            "rollouts": len(s.rollouts),
            "samples": s.samples,
            **{f"tokens_{name}": figure for name, figure in step_tokens(s).items()},
            "reward_mean": state.step_reward(s),
            "loss": s.metrics.get("loss"),
        }
        for s in state.steps
    ]
    summary["events"] = state.position
    summary["starts"] = state.starts
    summary["trainer_ranks"] = state.last_start.trainer_ranks if state.last_start is not None else 1
    # The recorded config is nested (by section) or, from earlier versions, flat.
    export_dir = (
        recorded_value(state.last_start.config, "export_dir") if state.last_start is not None else None
    )
    summary["disk_bytes"] = disk_usage(data_dir, Path(export_dir) if export_dir else None)
    start = state.last_start
    summary["agents"] = (start.agents or recorded_line(start.config)) if start is not None else None
    summary["checkpoint"] = state.checkpoint
    stop = state.last_stop  # the run's (``up``'s); an evaluation's stop is not the run's
    summary["stopped"] = (
        None if stop is None else {"reason": stop.reason, "failed": stop.failed, "ts": stop.ts}
    )
    summary["chain"] = _chain_status(db)
    # Remote engine replicas as the log knows them (``GET /admin/engines``: as the fleet does now).
    summary["replicas"] = [
        {
            "id": r.replica,
            "url": r.url,
            "version": r.policy_version,
            "state": r.state,
            "reason": r.reason,
            "weights": r.weights,
        }
        for r in state.replicas.values()
    ]

    def round_reasons(rollouts: Sequence[str]) -> list[dict[str, Any]]:
        views = [state.rollouts[r] for r in rollouts if r in state.rollouts]
        return [{"reason": reason, "count": count} for reason, count in grouped_reasons(views)]

    summary["validations"] = [
        {
            "step": v.step,
            "policy_version": v.policy_version,
            "rollouts": len(v.rollouts),
            "failed": v.failed,
            "failure_reasons": round_reasons(v.rollouts),
            "reward_mean": v.reward_mean,
            "reward_std": v.reward_std,
        }
        for v in state.validations
    ]
    summary["evaluations"] = [
        {
            "split": e.split,
            "repeat": e.repeat,
            "agent": e.agent,
            "step": e.step,
            "policy_version": e.policy_version,
            "rollouts": len(e.rollouts),
            "failed": e.failed,
            "failure_reasons": round_reasons(e.rollouts),
            "reward_mean": e.reward_mean,
            "reward_std": e.reward_std,
        }
        for e in state.evaluations
    ]
    return summary


def disk_usage(data_dir: Path, export_dir: Path | None = None) -> dict[str, int]:
    """Bytes the run takes on disk, by part: ``log`` (``events.sqlite`` with its WAL and
    shared-memory files), the checkpoints by kind (``trainer.checkpoints``): ``checkpoints``
    (full: fp32 weights + optimizer state), ``weights`` (per-version fp32 weights,
    ``checkpoints/weights``) and ``published`` (bf16 copies of published versions,
    ``checkpoints/published``), ``export`` (``export_dir``, None: ``<data_dir>/export``;
    counted also when it lies outside ``data_dir``), the cached ``models``, everything
    ``other`` in ``data_dir``, and their ``total``. Directories count recursively; symbolic
    links are not followed; a file removed while it is counted (a running appliance rotates
    checkpoints) counts 0."""
    checkpoints = data_dir / "checkpoints"
    kinds = {"weights": checkpoints / "weights", "published": checkpoints / "published"}
    try:
        full = [entry for entry in checkpoints.iterdir() if entry not in kinds.values()]
    except OSError:
        full = []
    paths = {
        "log": [data_dir / name for name in ("events.sqlite", "events.sqlite-wal", "events.sqlite-shm")],
        "checkpoints": full,
        **{kind: [path] for kind, path in kinds.items()},
        "export": [export_dir if export_dir is not None else data_dir / "export"],
        "models": [data_dir / "models"],
    }
    counted = {checkpoints.absolute(), *(path.absolute() for part in paths.values() for path in part)}
    try:
        paths["other"] = [entry for entry in data_dir.iterdir() if entry.absolute() not in counted]
    except OSError:
        paths["other"] = []
    parts = {part: sum(_tree_bytes(path) for path in part_paths) for part, part_paths in paths.items()}
    parts["total"] = sum(parts.values())
    return parts


def _tree_bytes(path: Path) -> int:
    """Size of a file, or of every file under a directory; 0 for what is not there."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: "512 B", "3.4 MiB", "1.2 GiB"."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _chain_status(db: Path) -> str:
    """Whether the log's checksum chain holds (status reports a broken one, it does not fail)."""
    from contracts.errors import StoreError
    from store.eventstore import verify_log

    try:
        return f"verified ({verify_log(db).events} events)"
    except StoreError as exc:
        return f"NOT verified: {exc.message}"


def _groups(reasons: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(str(g["reason"]), int(g["count"])) for g in reasons]


def _round_text(round_: dict[str, Any]) -> str:
    """A validation or evaluation round's reward and failures; a round none of whose rollouts
    finished has no reward to show (``no rollout finished: 6 failed: ...``)."""
    from store.outcomes import count_text, none_finished_text

    groups = _groups(round_["failure_reasons"])
    if round_["rollouts"] and round_["failed"] == round_["rollouts"]:
        return none_finished_text(round_["failed"], groups)
    return f"reward {round_['reward_mean']:.3f} +- {round_['reward_std']:.3f}  " + count_text(
        round_["failed"], groups
    )


def _print_status(summary: dict[str, Any]) -> None:
    from store.outcomes import count_text
    from store.token_figures import NAMES, tokens_text

    counts = summary["rollouts"]
    reward = summary["mean_reward"]
    print(
        f"run {summary['run_id'] or '-'}  phase {summary['phase']}  starts {summary['starts']}  "
        f"trainer ranks {summary['trainer_ranks']}"
    )
    print(
        f"policy v{summary['policy_version']}  step {summary['step']}  "
        f"checkpoint {summary['checkpoint'] or '-'}  events {summary['events']}"
    )
    if (stopped := summary.get("stopped")) is not None:
        label = "stopped (the run could not go on)" if stopped["failed"] else "stopped"
        print(f"{label}: {stopped['reason']}")
    print(f"checksum chain {summary['chain']}")
    for replica in summary.get("replicas", []):
        version = f"v{replica['version']}" if replica["version"] >= 0 else "v?"
        reason = f" ({replica['reason']})" if replica["reason"] else ""
        weights = f"  weights by {replica['weights']}" if replica.get("weights") else ""
        print(
            f"remote engine {replica['id']} {replica['url']}  {version}  {replica['state']}{weights}{reason}"
        )
    if summary.get("agents"):
        print(summary["agents"])
    disk = summary["disk_bytes"]
    print(
        f"disk {human_bytes(disk['total'])} ("
        + ", ".join(f"{part} {human_bytes(disk[part])}" for part in disk if part != "total")
        + ")"
    )
    print(
        "rollouts "
        + "  ".join(f"{k} {v}" for k, v in counts.items())
        + f"  calls {summary['calls']}  "
        + tokens_text({name: summary[f"tokens_{name}"] for name in NAMES})
    )
    if counts.get("failed"):
        print("  " + count_text(counts["failed"], _groups(summary["failure_reasons"])))
    print("last step mean reward " + reward_text(reward))
    for s in summary["steps_detail"]:
        print(
            f"  step {s['step']:>4}  rollouts {s['rollouts']:>3}  samples {s['samples']:>3}  "
            + tokens_text({name: s[f"tokens_{name}"] for name in NAMES}, 5)
            + f"  reward {reward_text(s['reward_mean'])}  loss {loss_text(s['loss'])}"
        )
    for v in summary["validations"]:
        print(
            f"  validation at step {v['step']:>4}  policy v{v['policy_version']}  "
            f"rollouts {v['rollouts']:>3}  " + _round_text(v)
        )
    for e in summary.get("evaluations", []):
        print(
            f"  eval {e['split']} at step {e['step']:>4}  policy v{e['policy_version']}  "
            f"rollouts {e['rollouts']:>3} ({e['repeat']}x)  "
            + _round_text(e)
            + (f"  agent {e['agent']}" if e.get("agent") else "")
        )
    if "failures" in summary:
        failures = summary["failures"]
        print(f"last {len(failures)} failed rollouts" if failures else "no failed rollouts")
        for f in failures:
            purpose = "" if f["purpose"] == "train" else f" ({f['purpose']})"
            print(f"  {f['rollout']}  task {f['task_id']}{purpose}  {f['reason']}")
