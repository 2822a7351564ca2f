"""What every view says about rollouts: the name of their state and why they failed.

Owns the words that ``status``, ``eval``, the headless step line of ``up`` and the dashboard
share, so that they agree:

* a rollout's state (:func:`state_of`): "offered" while an external runner has not claimed it
  (a rollout of the ``external`` adapter without ``RolloutClaimed``), then "running",
  "finished" or "failed" as ``RolloutFinished`` recorded;
* why rollouts failed (:func:`failures_text`): the reasons grouped, most frequent first, each
  on one line (:func:`store.projections.one_line`) with its count, e.g.
  ``failed 5: timed out after 120 s x5``. A reason is the text the log recorded, whatever
  wrote it; a rollout that finished without a reward (which validation and evaluation count
  as failed) reads "finished without a reward".

Nothing here folds events or reads the store: callers pass the rollout views they count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from store.projections import RolloutView, one_line

#: Every state a rollout is shown in, in the order views list them.
STATES = ("offered", "running", "finished", "failed")
#: The adapter whose rollouts wait for a runner elsewhere to claim them.
EXTERNAL_ADAPTER = "external"
#: The reason of a failure that recorded none.
NO_REASON = "no reason recorded"
#: The reason of a rollout counted as failed because it finished without a reward.
NO_REWARD = "finished without a reward"
#: Characters of a reason kept on a summary line (a table cuts it to its own width).
REASON_WIDTH = 160
#: Distinct reasons a summary line names; the rest are counted together.
SHOWN_REASONS = 3


def state_of(view: RolloutView) -> str:
    """The state every view shows ``view`` in: one of :data:`STATES`."""
    if view.status == "running" and view.adapter == EXTERNAL_ADAPTER and not view.claimed:
        return "offered"
    return view.status


def state_counts(views: Iterable[RolloutView]) -> dict[str, int]:
    """How many of ``views`` are in each state, every state of :data:`STATES` listed."""
    counts = dict.fromkeys(STATES, 0)
    for view in views:
        state = state_of(view)
        counts[state] = counts.get(state, 0) + 1
    return counts


def reason_of(view: RolloutView, width: int = REASON_WIDTH) -> str:
    """Why ``view`` failed, on one line of at most about ``width`` characters ("" for a rollout
    that is not over, or finished with a reward)."""
    if view.status == "failed":
        return one_line(view.error, width) or NO_REASON
    if view.status == "finished" and view.reward is None:
        return NO_REWARD
    return ""


def grouped_reasons(views: Iterable[RolloutView]) -> list[tuple[str, int]]:
    """The reasons of ``views`` that failed, with how many each: the most frequent first, ties
    in the order first seen."""
    counts = Counter(reason for view in views if (reason := reason_of(view)))
    return counts.most_common()


def reasons_text(groups: Sequence[tuple[str, int]], shown: int = SHOWN_REASONS) -> str:
    """Grouped reasons (:func:`grouped_reasons`) as one line: ``timed out after 120 s x3;
    ValueError: boom x1``; past ``shown`` distinct reasons the rest are counted together
    (``+2 other reasons x4``); "" when there are none."""
    parts = [f"{reason} x{count}" for reason, count in groups[:shown]]
    rest = groups[shown:]
    if rest:
        parts.append(f"+{len(rest)} other reason{'s' if len(rest) > 1 else ''} x{sum(c for _, c in rest)}")
    return "; ".join(parts)


def count_text(count: int, groups: Sequence[tuple[str, int]], label: str = "failed") -> str:
    """``failed 5: timed out after 120 s x5``: a count of failures and their grouped reasons;
    ``failed 0`` when there are none."""
    reasons = reasons_text(groups)
    return f"{label} {count}" + (f": {reasons}" if reasons else "")


def failures_text(failed: Iterable[RolloutView], label: str = "failed") -> str:
    """:func:`count_text` of the ``failed`` rollouts given (the caller decides what counts as
    failed: ``status`` its failed rollouts, evaluation also those finished without a reward)."""
    views = list(failed)
    return count_text(len(views), grouped_reasons(views), label)


def none_finished_text(count: int, groups: Sequence[tuple[str, int]]) -> str:
    """A round in which every rollout failed, so there is no reward to report: ``no rollout
    finished: 6 failed: ValueError: boom x6`` (the reasons as :func:`count_text` gives them)."""
    reasons = reasons_text(groups)
    return f"no rollout finished: {count} failed" + (f": {reasons}" if reasons else "")
