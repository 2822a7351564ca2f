"""The figures an experiment tracker plots, folded from the event log: :class:`StepRows`.

Owns the names and units of the tracked figures (docs/tracking.md lists them) and the fold that
turns the run's events into rows of them, one per training step plus one per validation round
and per evaluation, each at a point of the step axis. The axis is the policy version: a step's
row sits at the version the step published (the version served before it, for a step that
published none), a validation round's and an evaluation's at the version they ran on. A resumed
run folds the same log, so its rows continue the same axis.

A step's row closes when its switch ends (the ``PhaseChanged`` "generate" after it, in every
mode), so the phases recorded after the step's own event (offload, wake, push) are in it; a
step that never reaches it (a crash, a step that published nothing in split mode) closes at the
next step or start. The fold is pure (no clock, no I/O): ``appliance.reporting.trackers`` feeds it the
events of :data:`TYPES` and writes what it returns. It does not own the trackers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from store import events

#: The event types the fold reads (everything else, the calls above all, is skipped unread).
TYPES: tuple[str, ...] = tuple(
    cls.type
    for cls in (
        events.ApplianceStarted,
        events.ApplianceStopped,
        events.EvaluationCompleted,
        events.PhaseChanged,
        events.PolicyVersionPublished,
        events.RolloutFinished,
        events.SwitchPhaseCompleted,
        events.TrainStepCompleted,
        events.ValidationCompleted,
    )
)

#: ``TrainStepCompleted.metrics`` keys -> tracked names. Keys not listed go under "train/".
METRIC_NAMES: dict[str, str] = {
    "reward_mean": "reward/train_mean",
    "reward_std": "reward/train_std",
    "rollouts_failed": "train/rollouts_failed",
    "tokens_sampled": "tokens/sampled",
    "tokens_prompt": "tokens/prompt",
    "tokens_trained": "tokens/trained",
    "loss": "train/policy_loss",
    "entropy": "train/entropy",
    "ppo_kl": "train/kl_old",
    "kl_ref": "train/kl_ref",
    "grad_norm": "train/grad_norm",
    "pg_clipfrac": "train/clip_fraction",
    "samples_per_rollout": "train/samples_per_rollout",
    "tokens_per_s": "throughput/trained_tokens_per_s",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "stale_tokens": "staleness/tokens_stale",
    "stale_tokens_dropped": "staleness/tokens_masked",
    "memory_rss_gib": "memory/host_rss_gib",
    "memory_gpu_peak_gib": "memory/gpu_peak_gib",
    "engine_rss_gib": "memory/engine_host_rss_gib",
    "trainer_ranks_rss_gib": "memory/trainer_ranks_host_rss_gib",
}


@dataclass(frozen=True, slots=True)
class Row:
    """Figures at one point of the step axis."""

    #: The log position of the event that closed the row (a tracker's cursor compares to it).
    position: int
    #: The step axis: a policy version.
    step: int
    values: dict[str, float]
    #: Distributions at the same point (TensorBoard histograms): each a name and its values.
    histograms: dict[str, tuple[float, ...]] = field(default_factory=dict)


@dataclass
class StepRows:
    """Folds events (in log order) into :class:`Row` s; ``apply`` returns the rows an event closed."""

    #: The policy version published last.
    version: int = 0
    _step: tuple[events.TrainStepCompleted, int] | None = None
    #: The wall clock of the current cycle (from the previous step's close, or the start).
    _cycle_start: float | None = None
    _last_ts: float = 0.0
    _finished: int = 0
    _phases: dict[str, float] = field(default_factory=dict)
    #: The cycle's step stopped generation (a ``PhaseChanged`` "train": not split placement).
    _stops_generation: bool = False

    def apply(self, event: events.Event, position: int) -> list[Row]:
        rows: list[Row] = []
        match event:
            case events.ApplianceStarted():
                rows += self._close(position, None)  # a crash: the downtime is no cycle
                self.version = event.resumed_from_version
                self._new_cycle(event.ts)
            case events.ApplianceStopped():
                rows += self._close(position, event.ts)
                self._cycle_start = None
            case events.PhaseChanged(phase="train"):
                self._stops_generation = True
            case events.PhaseChanged(phase="generate"):
                rows += self._close(position, event.ts)
            case events.SwitchPhaseCompleted():
                self._phases[event.phase] = self._phases.get(event.phase, 0.0) + event.duration_s
            case events.TrainStepCompleted():
                rows += self._close(position, None)
                self._step = (event, position)
            case events.PolicyVersionPublished():
                self.version = event.policy_version
            case events.RolloutFinished():
                self._finished += 1
            case events.ValidationCompleted():
                rows.append(self._round("validation", event, position))
            case events.EvaluationCompleted():
                rows.append(self._round("evaluation", event, position))
            case _:
                pass
        self._last_ts = max(self._last_ts, event.ts)
        return rows

    def _round(
        self, purpose: str, event: events.ValidationCompleted | events.EvaluationCompleted, position: int
    ) -> Row:
        values = {
            f"reward/{purpose}_mean": event.reward_mean,
            f"reward/{purpose}_std": event.reward_std,
            f"{purpose}/rollouts": float(len(event.rollouts)),
            f"{purpose}/failed": float(event.failed),
        }
        return Row(position, event.policy_version, values)

    def _new_cycle(self, ts: float | None) -> None:
        self._cycle_start, self._finished, self._phases, self._stops_generation = ts, 0, {}, False

    def _close(self, position: int, ts: float | None) -> list[Row]:
        """The pending step's row, closed by the event at ``position`` at wall time ``ts`` (None:
        not a clean end of its cycle; the cycle's times are left out)."""
        if self._step is None:
            return []
        step, _ = self._step
        self._step = None
        values: dict[str, float] = {
            METRIC_NAMES.get(key, f"train/{key}"): float(value) for key, value in step.metrics.items()
        }
        values.update(
            {
                "train/step": float(step.step),
                "train/rollouts": float(len(step.rollouts)),
                "train/samples": float(step.samples),
                "train/zero_variance_groups": float(step.zero_variance_groups),
                "time/step_s": step.duration_s,
            }
        )
        for phase, seconds in self._phases.items():
            values[f"time/{phase}_s"] = seconds
        train_s = self._phases.get("train", step.duration_s)
        switch_s = sum(s for phase, s in self._phases.items() if phase != "train")
        values["time/switch_s"] = switch_s
        end = ts if ts is not None else (self._last_ts or None)
        if self._cycle_start is not None and end is not None and end > self._cycle_start:
            cycle_s = end - self._cycle_start
            paused = switch_s + (train_s if self._stops_generation else 0.0)
            values["time/cycle_s"] = cycle_s
            values["time/generate_s"] = max(0.0, cycle_s - paused)
            values["throughput/rollouts_per_s"] = self._finished / cycle_s
            if values["time/generate_s"] > 0 and step.sampled:
                values["throughput/generation_tokens_per_s"] = sum(step.sampled) / values["time/generate_s"]
        self._new_cycle(end)
        histograms = {"reward/train": step.rewards, "rollout/sampled_tokens": tuple(map(float, step.sampled))}
        return [Row(position, self.version, values, {k: v for k, v in histograms.items() if v})]
