"""Simulated runs by mode: one run, and the comparisons ``scripts/simulate.py`` tabulates.

Owns :func:`simulate` (a policy for ``mode`` and ``eta``, run for ``warmup + steps`` steps and
measured over the last ``steps``), :func:`compare` (sync against async) and
:func:`compare_placements` (collocated against split on one layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from appliance.scheduler.decide import Mode, SchedulePolicy
from appliance.scheduler.simulate.costs import CostModel, Layout
from appliance.scheduler.simulate.loop import Simulator
from appliance.scheduler.simulate.results import SimResult
from appliance.scheduler.simulate.workloads import Workload


def simulate(
    workload: Workload,
    cost: CostModel,
    *,
    mode: Mode,
    eta: int = 0,
    batch_groups: int = 8,
    group_size: int = 8,
    steps: int = 20,
    warmup: int = 3,
    seed: int = 0,
    min_generate_s: float = 0.0,
    layout: Layout | None = None,
) -> SimResult:
    """Run ``warmup + steps`` steps and measure the last ``steps``."""
    policy = SchedulePolicy(
        batch_groups=batch_groups,
        group_size=group_size,
        max_steps=warmup + steps,
        mode=mode,
        eta=eta,
        min_generate_s=min_generate_s,
    )
    simulator = Simulator(policy, cost, workload, seed, layout)
    simulator.run()
    return simulator.result(warmup)


def compare(
    workloads: Iterable[Workload], cost: CostModel, *, etas: Sequence[int] = (0, 1, 2), **kwargs: Any
) -> list[SimResult]:
    """For each workload: sync, then async at each ``eta`` (``kwargs`` go to :func:`simulate`)."""
    results: list[SimResult] = []
    for workload in workloads:
        results.append(simulate(workload, cost, mode="sync", **kwargs))
        results.extend(simulate(workload, cost, mode="async", eta=eta, **kwargs) for eta in etas)
    return results


def compare_placements(
    workloads: Iterable[Workload],
    cost: CostModel,
    layout: Layout,
    *,
    etas: Sequence[int] = (1, 2),
    **kwargs: Any,
) -> list[SimResult]:
    """For each workload on ``layout``'s GPUs: collocated sync, collocated async at each ``eta``,
    then split at each ``eta`` (``kwargs`` go to :func:`simulate`)."""
    results: list[SimResult] = []
    for workload in workloads:
        results.append(simulate(workload, cost, mode="sync", layout=layout, **kwargs))
        for mode in ("async", "split"):
            results.extend(
                simulate(workload, cost, mode=mode, eta=eta, layout=layout, **kwargs) for eta in etas
            )
    return results
