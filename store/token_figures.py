"""The run's token figures, each named and defined once for every view (docs/metrics.md).

* **sampled**: tokens the policy sampled for recorded model calls (each call's response).
* **prompt**: tokens of recorded model calls' prompts, each call's whole prompt (a conversation's
  earlier turns count again in every later call, as a provider's ``prompt_tokens`` would).
* **trained**: sampled tokens a training step's loss held (after truncation, and after tokens
  too stale were dropped).

A step's figures are its ``TrainStepCompleted.metrics`` under :data:`KEYS` (sampled and prompt
over the step's rollouts, failed ones included); a run's are the sums over its rollouts
(sampled, prompt: every purpose) and over its steps (trained). The step line of ``up``,
``status``, the dashboard, the trackers (``tokens/<name>``) and ``/metrics``
(``appliance_<name>_tokens_total``) all use these names. This module owns the names and their
text, not the counting (``store.projections`` counts per rollout, the training service per step).
"""

from __future__ import annotations

from collections.abc import Mapping

from store.events import TrainStepCompleted

#: The figures, in the order every view shows them.
NAMES: tuple[str, ...] = ("sampled", "trained", "prompt")
#: Each figure's key in a step's metrics and in ``RunState.summary``.
KEYS: dict[str, str] = {name: f"tokens_{name}" for name in NAMES}


def step_tokens(step: TrainStepCompleted) -> dict[str, int | None]:
    """``step``'s figures by name (None: a step recorded before they were)."""
    return {name: int(step.metrics[key]) if key in step.metrics else None for name, key in KEYS.items()}


def tokens_text(figures: Mapping[str, int | None], width: int = 0) -> str:
    """``tokens sampled 419  trained 117  prompt 2310`` (each number right-aligned to ``width``;
    "-" for a figure not recorded)."""
    parts = (f"{name} {'-' if figures.get(name) is None else figures[name]:>{width}}" for name in NAMES)
    return "tokens " + "  ".join(parts)
