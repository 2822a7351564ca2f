"""The run's training figures for ``GET /metrics``, read at scrape time: :func:`run_families`,
:func:`gpu_families`.

Owns the Prometheus names of what the run state (``store.projections.RunState``) holds about
rollouts and steps: the rewards and durations of the rollouts that ended, as histograms by
purpose; the tokens trained on (``store.token_figures``); the last step's figures (reward, loss,
entropy, the two KL estimates, gradient norm, clip fraction, how many versions the trained
tokens lagged behind the trained policy, its trained tokens per second and the resident memory
recorded after it); and the GPU memory torch's allocator holds in this process, where torch
already runs on CUDA here (no family has a sample on CPU, and none is added for vLLM's own
processes: vLLM's ``/metrics`` has its KV cache). docs/metrics.md lists them all.

Nothing is counted on the hot path: a scrape walks the rollouts once (as the rollout counts of
``appliance.proxy.metrics`` do). It does not own the registry, the route nor the per-call figures
(``appliance.proxy.metrics``).
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from store.projections import RunState

__all__ = [
    "DURATION_BUCKETS_S",
    "REWARD_BUCKETS",
    "buckets",
    "cuda_in_use",
    "gauge",
    "gpu_families",
    "run_families",
]

#: Bucket bounds of a rollout's reward (most harnesses score in [0, 1]). None is negative: a
#: negative reward counts in the first bucket (``le="0.0"``), and the family keeps its ``_sum``
#: and ``_count`` (OpenMetrics drops them from a histogram with a negative bound).
REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0, 10.0)
#: Bucket bounds of a rollout's duration in seconds, its start to its end.
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
GIB = 1024**3

#: The last step's figures: ``TrainStepCompleted.metrics`` key -> (Prometheus name, help).
LAST_STEP: dict[str, tuple[str, str]] = {
    "reward_mean": ("appliance_step_reward_mean", "Mean reward of the last step's rollouts"),
    "reward_std": ("appliance_step_reward_std", "Population std of the last step's rewards"),
    "loss": ("appliance_step_policy_loss", "The last step's normalized policy loss (KL term included)"),
    "entropy": ("appliance_step_entropy_nats", "Mean entropy at the last step's trained tokens"),
    "ppo_kl": ("appliance_step_kl_old_nats", "Mean KL to the sampling policy at the last step's tokens"),
    "kl_ref": ("appliance_step_kl_ref_nats", "Mean KL estimate to the reference model (0: none), last step"),
    "grad_norm": ("appliance_step_grad_norm", "The last step's total gradient norm before clipping"),
    "pg_clipfrac": ("appliance_step_clip_fraction", "Fraction of the last step's tokens clipped"),
    "tokens_per_s": (
        "appliance_step_trained_tokens_per_second",
        "Trained tokens per second of the last step's trainer time",
    ),
}  # fmt: skip
#: Resident host memory recorded after the last step: metrics key -> the ``process`` label.
STEP_MEMORY = {
    "memory_rss_gib": "appliance",
    "engine_rss_gib": "engine",
    "trainer_ranks_rss_gib": "trainer_ranks",
}


def run_families(state: RunState) -> Iterator[Metric]:
    """The run's rollout and step figures, from ``state``."""
    yield from _rollouts(state)
    yield CounterMetricFamily(
        "appliance_trained_tokens",
        "Sampled tokens the training steps' losses held (the run's steps, all starts)",
        value=sum(s.metrics.get("tokens_trained", 0.0) for s in state.steps),
    )
    yield gauge(
        "appliance_published_policy_version",
        "Policy version the trainer published last (appliance_policy_version: the one served)",
        state.policy_version,
    )
    metrics = state.steps[-1].metrics if state.steps else {}
    for key, (name, documentation) in LAST_STEP.items():
        family = GaugeMetricFamily(name, documentation)
        if key in metrics:
            family.add_metric((), float(metrics[key]))
        yield family
    duration = GaugeMetricFamily("appliance_step_duration_seconds", "Seconds the last training step took")
    if state.steps:
        duration.add_metric((), state.steps[-1].duration_s)
    yield duration
    lag = GaugeMetricFamily(
        "appliance_step_policy_version_lag",
        "Policy versions between the policy the last step trained and the one that sampled its "
        "trained tokens: mean and max",
        labels=("stat",),
    )
    for stat in ("mean", "max"):
        if f"staleness_{stat}" in metrics:
            lag.add_metric((stat,), float(metrics[f"staleness_{stat}"]))
    yield lag
    memory = GaugeMetricFamily(
        "appliance_step_resident_memory_bytes",
        "Resident host memory after the last step: the appliance's process, vLLM's processes, the "
        "trainer's rank processes (each where it has its own)",
        labels=("process",),
    )
    for key, process in STEP_MEMORY.items():
        if key in metrics:
            memory.add_metric((process,), float(metrics[key]) * GIB)
    yield memory
    peak = GaugeMetricFamily(
        "appliance_step_gpu_memory_peak_bytes",
        "The most GPU memory torch's allocator held in the appliance's process in the last step (CUDA only)",
    )
    if "memory_gpu_peak_gib" in metrics:
        peak.add_metric((), float(metrics["memory_gpu_peak_gib"]) * GIB)
    yield peak


def _rollouts(state: RunState) -> Iterator[Metric]:
    """Rewards and durations of the rollouts that ended, by purpose."""
    rewards: dict[str, list[int]] = {}
    reward_sums: dict[str, float] = {}
    durations: dict[str, list[int]] = {}
    duration_sums: dict[str, float] = {}
    for view in state.rollouts.values():
        if view.status not in ("finished", "failed"):
            continue
        if view.reward is not None and view.status == "finished":
            counts = rewards.setdefault(view.purpose, [0] * (len(REWARD_BUCKETS) + 1))
            counts[bisect.bisect_left(REWARD_BUCKETS, view.reward)] += 1
            reward_sums[view.purpose] = reward_sums.get(view.purpose, 0.0) + view.reward
        if view.duration_s is not None:
            counts = durations.setdefault(view.purpose, [0] * (len(DURATION_BUCKETS_S) + 1))
            counts[bisect.bisect_left(DURATION_BUCKETS_S, view.duration_s)] += 1
            duration_sums[view.purpose] = duration_sums.get(view.purpose, 0.0) + view.duration_s
    reward = HistogramMetricFamily(
        "appliance_rollout_reward",
        "Rewards of the rollouts that finished with one, by purpose (train, validation, evaluation)",
        labels=("purpose",),
    )
    for purpose, counts in sorted(rewards.items()):
        reward.add_metric((purpose,), buckets(REWARD_BUCKETS, counts), reward_sums[purpose])
    yield reward
    duration = HistogramMetricFamily(
        "appliance_rollout_duration_seconds",
        "Seconds from a rollout's start to its end, for those that ended (finished or failed), by purpose",
        labels=("purpose",),
    )
    for purpose, counts in sorted(durations.items()):
        duration.add_metric((purpose,), buckets(DURATION_BUCKETS_S, counts), duration_sums[purpose])
    yield duration


def gpu_families() -> Iterator[Metric]:
    """GPU memory torch's allocator holds in this process, by device: only where torch is
    imported here and has already started CUDA (a scrape never starts it: that would take a
    GPU context); on CPU the families have no sample."""
    allocated = GaugeMetricFamily(
        "appliance_gpu_memory_allocated_bytes",
        "GPU memory torch's tensors hold in the appliance's process, by device (CUDA only)",
        labels=("device",),
    )
    reserved = GaugeMetricFamily(
        "appliance_gpu_memory_reserved_bytes",
        "GPU memory torch's caching allocator reserved in the appliance's process, by device (CUDA only)",
        labels=("device",),
    )
    if cuda_in_use():
        torch = sys.modules["torch"]
        for device in range(torch.cuda.device_count()):
            allocated.add_metric((str(device),), float(torch.cuda.memory_allocated(device)))
            reserved.add_metric((str(device),), float(torch.cuda.memory_reserved(device)))
    yield from (allocated, reserved)


def cuda_in_use() -> bool:
    """Whether torch is imported in this process and has started CUDA (asked without starting it)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts as Prometheus' cumulative ``le`` buckets, ``+Inf`` last."""
    labels = [repr(float(bound)) for bound in bounds] + ["+Inf"]
    return [(le, float(n)) for le, n in zip(labels, itertools.accumulate(counts), strict=True)]


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))
