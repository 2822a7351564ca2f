"""The ``[scheduler]`` section: batches, the mode and its staleness bound, validation rounds,
the deadlines of a switch and the circuit breaker (``SchedulePolicy.from_config`` and the
scheduler's runner read it). Owns the knobs' one declaration (``ScheduleKnobs``), which the
section and the decisions' ``SchedulePolicy`` share. It does not own the decisions
(``appliance.scheduler``)."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.checks import at_least, one_of, seconds
from contracts.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleKnobs:
    """The scheduler's knobs, each declared here once, with what it means and its default as a
    run's config has it. Two classes are made of them: ``SchedulerConfig`` (the section, every
    value checked as a user's) and ``appliance.scheduler.decide.SchedulePolicy`` (the same knobs
    as the decisions read them, made concrete for a placement). Nothing is checked here."""

    #: Rollouts per task group (GRPO compares the rollouts of one group).
    group_size: int = 4
    #: Task groups per training step.
    batch_groups: int = 2
    #: Stop when the run reaches this training step (None: until interrupted).
    max_steps: int | None = None
    #: "sync" (generate a batch, then train) or "async" (collocated: train as soon as a batch of
    #: groups is ready; rollouts still running are preempted and continue under the new weights).
    #: With placement = "split" the scheduler runs split mode (generation never stops for a step,
    #: docs/scheduler.md): "async" bounds it by eta, "sync" keeps it on-policy (eta 0).
    mode: str = "sync"
    #: Staleness bound (async): a rollout starts at most this many versions before the version
    #: it is trained at, and sampled tokens older than that are dropped from the loss.
    eta: int = 1
    #: What happens to sampled tokens older than eta versions: "drop" (masked out of the loss)
    #: or "reweight" (kept, weighted by the clipped importance ratio to their sampling policy).
    stale_tokens: str = "drop"
    #: Most rollouts running at once in async mode (None: batch_groups * group_size * (eta + 1)).
    max_inflight_rollouts: int | None = None
    #: Seconds the machine generates at least before switching to training again (async).
    min_generate_s: float = 0.0
    #: Engine sleep level during training: 1 offloads weights to host memory, 2 discards them.
    sleep_level: int = 1
    #: Steps between validation rounds (a baseline round runs at step 0; 0 turns them off).
    validate_every: int = 5
    #: Held-out tasks per validation round (one rollout each; the same tasks every round).
    validation_tasks: int = 8
    #: Evaluation sampling of validation calls: temperature (0 = greedy) and completion
    #: length (None: max_tokens).
    validation_temperature: float = 0.0
    validation_max_tokens: int | None = None
    #: A validation round runs alone: no training group is admitted from its start to its end
    #: (rollouts under way go on), so its rollouts share the engine with no more than those.
    #: False admits beside it as the bounds allow (on a GPU that batches them, nearly free; on
    #: a machine whose engine is bound by its throughput, a round then waits behind them).
    validation_holds_admissions: bool = False
    #: Seconds the drain before a training step waits for the calls still generating; then
    #: they are preempted (they continue after the step), recorded (``PhaseOverran``), and the
    #: step goes on.
    drain_timeout_s: float = 30.0
    #: Seconds any other phase of a switch (sleep, onload, train, offload, wake, push) may take
    #: before it is reported as overrunning (``PhaseOverran``, ``/healthz`` not ok); it is not
    #: interrupted.
    phase_timeout_s: float = 1800.0
    #: Circuit breaker: after this many training rollouts failed in a row, admissions pause
    #: (``AdmissionsPaused``) for ``breaker_backoff_s``, doubling on each trip in a row up to
    #: ``breaker_backoff_max_s`` (0: no breaker).
    breaker_failures: int = 8
    breaker_backoff_s: float = 10.0
    breaker_backoff_max_s: float = 300.0
    # -- the circuit breaker gives up (appliance.scheduler.decide) --
    #: Trips of the circuit breaker in a row (no training rollout finished between them) after
    #: which the run stops with the last failure's reason and a non-zero exit (0: never stop).
    #: The count starts again at each start, so the same data directory resumes.
    breaker_max_trips: int = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig(ScheduleKnobs):
    """When the machine generates and when it trains: batches, the mode and its staleness bound,
    validation rounds, the deadlines of a switch and the circuit breaker
    (``SchedulePolicy.from_config`` and the scheduler's runner read this section). Its fields,
    in their order (the order ``ApplianceConfig.to_json`` records), are ``ScheduleKnobs``'."""

    def __post_init__(self) -> None:
        at_least("group_size", self.group_size, 1)
        at_least("batch_groups", self.batch_groups, 1)
        at_least("max_steps", self.max_steps, 0)
        one_of("mode", self.mode, ("sync", "async"))
        at_least("eta", self.eta, 0)
        one_of("stale_tokens", self.stale_tokens, ("drop", "reweight"))
        if self.max_inflight_rollouts is not None and self.max_inflight_rollouts < self.group_size:
            raise ConfigError(
                f"max_inflight_rollouts ({self.max_inflight_rollouts}) must be at least group_size "
                f"({self.group_size}): a group starts all its rollouts at once"
            )
        at_least("min_generate_s", self.min_generate_s, 0)
        one_of("sleep_level", self.sleep_level, (1, 2))
        at_least("validate_every", self.validate_every, 0, "off")
        at_least("validation_tasks", self.validation_tasks, 1)
        if not 0.0 <= self.validation_temperature <= 2.0:
            raise ConfigError(
                f"validation_temperature must be between 0 and 2; got {self.validation_temperature}"
            )
        at_least("validation_max_tokens", self.validation_max_tokens, 1)
        for name in ("drain_timeout_s", "phase_timeout_s", "breaker_backoff_s"):
            seconds(name, getattr(self, name))
        at_least("breaker_failures", self.breaker_failures, 0, "off")
        at_least("breaker_max_trips", self.breaker_max_trips, 0, "never stop")
        if not self.breaker_backoff_max_s >= self.breaker_backoff_s:
            raise ConfigError(
                f"breaker_backoff_max_s ({self.breaker_backoff_max_s}) must be at least "
                f"breaker_backoff_s ({self.breaker_backoff_s})"
            )
