"""What a simulated run measured: the counters, the window they are read over, the result.

Owns :class:`Meter` (cumulative counters the event loop adds to; a snapshot at each step end
delimits the measured window), :func:`measure` (one run's :class:`SimResult` from those
snapshots) and :class:`Breakdown` (where each step's time goes, with the floor that the
staleness bound puts under any schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from appliance.scheduler.decide import SchedulePolicy


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated run, measured over the steps after the warm-up."""

    workload: str
    mode: str
    eta: int
    steps: int
    #: End-to-end simulated seconds per training step.
    seconds_per_step: float
    #: Fraction of the GPU time (all GPUs) spent decoding, prefilling or training (switches and
    #: pushes excluded). A replica counts as busy while it decodes even one sequence.
    busy_fraction: float
    #: Fraction of the time generation is stopped by switches (both directions) or, in split
    #: mode, by weight pushes.
    switch_fraction: float
    #: Fraction of the time spent in training steps: of the whole machine's time collocated, of
    #: the training GPUs' in split mode.
    train_fraction: float
    #: Token-weighted mean of (step - 1 - version the token was sampled under) over trained
    #: sampled tokens; the step trains the weights of version ``step - 1``.
    mean_staleness: float
    #: The largest staleness of a trained token (at most ``eta``: the trainer masks the rest).
    max_staleness: int
    #: The largest staleness of a sampled token in a trained group, before that mask.
    max_sampled_staleness: int
    #: Fraction of sampled tokens in trained groups masked out as more than ``eta`` stale (async
    #: mode; the training service's ``bound_staleness``): a long rollout's oldest tokens, when
    #: later groups overtook it.
    masked_fraction: float
    #: Trained (unmasked) sampled tokens per second.
    trained_tokens_per_s: float
    #: Mean number of sequences decoding at once, while any decodes.
    mean_decode_batch: float
    #: Cached context tokens a switch or a push dropped (recomputed by prefill later), per step.
    dropped_kv_tokens_per_step: float
    stop_reason: str
    #: The layout: GPUs in all, generating, training (collocated: all three the same), and the
    #: engine replicas on the generating ones.
    gpus: int = 1
    gen_gpus: int = 1
    train_gpus: int = 1
    replicas: int = 1
    #: Fraction of the generating GPUs' time spent decoding or prefilling.
    gen_busy_fraction: float = 0.0
    #: Where each step's time goes, in seconds per step (:class:`Breakdown`).
    breakdown: Breakdown | None = None


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Seconds per step, over the measured window. ``idle`` and ``reprefill`` are the generating
    GPUs' (GPU-seconds over their count); the rest are wall-clock seconds. They overlap:
    ``idle`` and ``order_wait`` are generation time, ``reprefill`` part of the GPUs' busy time."""

    #: The engine serves (collocated: between switches; split: but for the pushes).
    generate: float
    #: Generating GPUs serving with nothing to decode or prefill (every rollout in a tool or
    #: waiting on none), while the engine serves.
    idle: float
    #: Prefill that recomputes context a switch or a push dropped from the KV cache.
    reprefill: float
    #: Serving while ``batch_groups`` groups are ready but an older group still runs (training
    #: in admission order waits for it).
    order_wait: float
    #: Switches (collocated) or pushes (split): generation stands still.
    pause: float
    #: The step itself (collocated: the whole machine; split: the training GPUs).
    train: float
    #: The step's critical rollout (the last of its groups to end): admission to end, of which
    #: in tools, and mid-call while the engine did not serve it (held by a switch, a step or a
    #: push); the rest it spent prefilling, decoding or queued for them. ``critical_served``:
    #: of its life, the seconds the engine served (not switching, training or pushing).
    critical: float
    critical_tool: float
    critical_held: float
    critical_served: float

    def floor(self, mode: str, eta: int) -> float:
        """The fewest seconds per step that these critical rollouts allow, within the staleness
        bound: a group admitted under version ``v`` is trained by step ``v + eta + 1``, so its
        life fits in ``eta + 1`` generation phases (and the ``eta`` steps between them).

        Collocated, the engine serves only between steps, so ``eta + 1`` generation phases
        must hold the critical rollout's serving time: ``pause + train + critical_served /
        (eta + 1)`` (sync: ``eta = 0``). Split, generation goes on beside the step, but a
        group admitted once a step's weights serve waits ``train + pause`` of the ``eta + 1``
        periods: ``(critical + train + pause) / (eta + 1)``, and never less than a step and
        its push. A bound on what reordering the same work could give, not a prediction."""
        eta = 0 if mode == "sync" else eta
        if mode == "split":
            return max(self.train + self.pause, (self.critical + self.train + self.pause) / (eta + 1))
        return self.pause + self.train + self.critical_served / (eta + 1)


@dataclass(slots=True)
class Meter:
    """Cumulative counters; a snapshot at each step end delimits the measured window."""

    now: float = 0.0
    gen_busy: float = 0.0  # GPU-seconds of replicas decoding or prefilling
    switch: float = 0.0  # seconds generation stood still for a switch or a push
    train: float = 0.0  # seconds a step ran
    serving: float = 0.0  # seconds the engine served (generate phase): the serving clock
    gen_idle: float = 0.0  # GPU-seconds the generating GPUs served with nothing to decode or prefill
    reprefill: float = 0.0  # GPU-seconds of prefill recomputing context a switch or a push dropped
    order_wait: float = 0.0  # seconds serving with a batch ready but an older group still running
    # The critical rollout of each step (the last of its groups to end), summed over steps:
    # admission to end, of which in tools, and mid-call while the engine did not serve it.
    critical: float = 0.0
    critical_tool: float = 0.0
    critical_held: float = 0.0
    critical_served: float = 0.0
    decoding: float = 0.0  # replica-seconds with at least one sequence decoding
    decode_seq_s: float = 0.0  # integral of the number of decoding sequences over time
    dropped_kv: float = 0.0
    stale_tokens: float = 0.0  # sum of staleness * tokens, over trained tokens
    tokens: float = 0.0  # trained sampled tokens
    masked: float = 0.0  # sampled tokens masked out as too stale
    max_staleness: int = 0  # of trained tokens, this step
    max_sampled_staleness: int = 0  # of sampled tokens in trained groups, this step


def measure(
    snapshots: Sequence[Meter],
    warmup: int,
    *,
    workload: str,
    policy: SchedulePolicy,
    stop_reason: str,
    gpus: int,
    gen_gpus: int,
    train_gpus: int,
    replicas: int,
) -> SimResult:
    """One run of ``policy`` over ``workload`` measured from the end of step ``warmup`` to the
    end of the last step: ``snapshots`` holds the meter at t=0 and at each step's end, the
    other arguments say what ran and on how many GPUs."""
    if len(snapshots) <= warmup + 1:
        raise ValueError(f"only {len(snapshots) - 1} steps ran; need more than warmup={warmup}")
    a, b = snapshots[warmup], snapshots[-1]
    window = snapshots[warmup + 1 :]
    span, steps = b.now - a.now, len(window)
    tokens, masked = b.tokens - a.tokens, b.masked - a.masked
    decoding = b.decoding - a.decoding
    gen_busy, train = b.gen_busy - a.gen_busy, b.train - a.train
    return SimResult(
        workload=workload,
        mode=policy.mode,
        eta=0 if policy.mode == "sync" else policy.eta,
        steps=steps,
        seconds_per_step=span / steps,
        busy_fraction=(gen_busy + train_gpus * train) / (gpus * span),
        switch_fraction=(b.switch - a.switch) / span,
        train_fraction=train / span,
        mean_staleness=(b.stale_tokens - a.stale_tokens) / tokens if tokens else 0.0,
        max_staleness=max(s.max_staleness for s in window),
        max_sampled_staleness=max(s.max_sampled_staleness for s in window),
        masked_fraction=masked / (tokens + masked) if tokens + masked else 0.0,
        trained_tokens_per_s=tokens / span,
        mean_decode_batch=(b.decode_seq_s - a.decode_seq_s) / decoding if decoding else 0.0,
        dropped_kv_tokens_per_step=(b.dropped_kv - a.dropped_kv) / steps,
        stop_reason=stop_reason,
        gpus=gpus,
        gen_gpus=gen_gpus,
        train_gpus=train_gpus,
        replicas=replicas,
        gen_busy_fraction=gen_busy / (gen_gpus * span),
        breakdown=Breakdown(
            generate=(b.serving - a.serving) / steps,
            idle=(b.gen_idle - a.gen_idle) / gen_gpus / steps,
            reprefill=(b.reprefill - a.reprefill) / gen_gpus / steps,
            order_wait=(b.order_wait - a.order_wait) / steps,
            pause=(b.switch - a.switch) / steps,
            train=train / steps,
            critical=(b.critical - a.critical) / steps,
            critical_tool=(b.critical_tool - a.critical_tool) / steps,
            critical_held=(b.critical_held - a.critical_held) / steps,
            critical_served=(b.critical_served - a.critical_served) / steps,
        ),
    )
