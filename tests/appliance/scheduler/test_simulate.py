"""The scheduling simulator: it finishes, conserves tokens, is deterministic, and predicts what
the scheduling modes promise (async no slower, faster on long tails, staleness within eta)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from appliance.scheduler.decide import Mode, SchedulePolicy
from appliance.scheduler.simulate import (
    SWE,
    UNIFORM,
    CostModel,
    SimResult,
    Simulator,
    Workload,
    compare,
    format_table,
    simulate,
)

COST = CostModel()
FREE_SWITCH = replace(COST, switch_to_train_s=0.0, switch_to_generate_s=0.0)
SMALL = {"batch_groups": 2, "group_size": 4, "steps": 6, "warmup": 1}


def run(
    workload: Workload,
    mode: Mode,
    eta: int = 0,
    steps: int = 7,
    min_generate_s: float = 0.0,
    max_inflight_rollouts: int | None = None,
) -> Simulator:
    """Two groups of four per step, seed 3, to the end."""
    policy = SchedulePolicy(
        batch_groups=2,
        group_size=4,
        max_steps=steps,
        mode=mode,
        eta=eta,
        min_generate_s=min_generate_s,
        max_inflight_rollouts=max_inflight_rollouts,
    )
    simulator = Simulator(
        policy,
        COST,
        workload,
        seed=3,
    )
    simulator.run()
    return simulator


def staleness(simulator: Simulator) -> list[int]:
    """Per trained token batch: the step that trained it, less one, less its sampling version."""
    return [
        group.trained_step - 1 - version
        for group in simulator.groups
        if group.trained_step is not None
        for rollout in group.rollouts
        for version in rollout.sampled
    ]


@pytest.mark.parametrize(("mode", "eta"), [("sync", 0), ("async", 0), ("async", 1), ("async", 2)])
def test_runs_reach_the_requested_steps(mode: Mode, eta: int) -> None:
    simulator = run(SWE, mode, eta)
    assert simulator.step == 7
    assert simulator.stop_reason == "reached step 7"
    assert len(simulator.snapshots) == 8


@pytest.mark.parametrize("workload", [SWE, UNIFORM])
def test_finished_rollouts_sampled_exactly_their_calls(workload: Workload) -> None:
    """Preemption splits a call's tokens across versions but loses or adds none."""
    simulator = run(workload, "async", eta=2)
    finished = [r for g in simulator.groups for r in g.rollouts if id(r) not in simulator.running]
    assert finished
    for rollout in finished:
        assert math.isclose(sum(rollout.sampled.values()), sum(c.gen_tokens for c in rollout.calls))
        assert math.isclose(rollout.context, sum(c.prompt_tokens + c.gen_tokens for c in rollout.calls))
        assert min(rollout.sampled) >= rollout.group.admitted_version


def test_uniform_async_eta0_no_slower_than_sync_without_switch_cost() -> None:
    sync = simulate(UNIFORM, FREE_SWITCH, mode="sync", **SMALL)
    async0 = simulate(UNIFORM, FREE_SWITCH, mode="async", eta=0, **SMALL)
    assert async0.seconds_per_step <= sync.seconds_per_step * (1 + 1e-9)


@pytest.mark.parametrize("eta", [1, 2])
def test_long_tailed_async_beats_sync(eta: int) -> None:
    sync = simulate(SWE, COST, mode="sync", **SMALL)
    faster = simulate(SWE, COST, mode="async", eta=eta, **SMALL)
    assert faster.seconds_per_step < 0.9 * sync.seconds_per_step
    assert faster.mean_staleness > 0.0


def test_sync_trains_only_on_policy_tokens() -> None:
    simulator = run(SWE, "sync")
    assert set(staleness(simulator)) == {0}
    result = simulator.result(warmup=1)
    assert result.max_staleness == result.max_sampled_staleness == 0
    assert result.masked_fraction == 0.0


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_uniform_staleness_within_eta(eta: int) -> None:
    simulator = run(UNIFORM, "async", eta)
    values = staleness(simulator)
    assert values and min(values) >= 0 and max(values) <= eta
    assert simulator.result(warmup=1).masked_fraction == 0.0


@pytest.mark.parametrize("eta", [1, 2])
def test_sampled_tokens_within_eta_on_long_tails(eta: int) -> None:
    """Groups are trained in admission order, so a long group is never overtaken: even on a
    long-tailed workload no sampled token is older than eta, and nothing has to be masked."""
    simulator = run(SWE, "async", eta, steps=12)
    assert max(staleness(simulator)) <= eta
    result = simulator.result(warmup=1)
    assert result.max_sampled_staleness <= eta
    assert result.masked_fraction == 0.0
    assert result.max_staleness > 0  # asynchrony happened: some tokens are off-policy


def test_admissions_respect_the_staleness_bound() -> None:
    """What decide does promise: group g starts no more than eta versions before g // B."""
    for eta in (0, 1, 2):
        simulator = run(SWE, "async", eta)
        for group in simulator.groups:
            assert group.index // 2 - group.admitted_version <= eta


def test_deterministic_for_a_seed() -> None:
    def once(seed: int) -> SimResult:
        return simulate(SWE, COST, mode="async", eta=1, seed=seed, **SMALL)

    assert once(5) == once(5)
    assert once(5) != once(6)


@pytest.mark.parametrize(
    ("workload", "mode", "eta"), [(SWE, "sync", 0), (SWE, "async", 2), (UNIFORM, "async", 1)]
)
def test_fractions_are_fractions(workload: Workload, mode: Mode, eta: int) -> None:
    result = simulate(workload, COST, mode=mode, eta=eta, **SMALL)
    assert 0.0 <= result.busy_fraction <= 1.0
    assert 0.0 < result.switch_fraction < 1.0
    assert result.busy_fraction + result.switch_fraction <= 1.0 + 1e-9
    assert result.train_fraction <= result.busy_fraction


def test_min_generate_s_delays_training_without_stalling() -> None:
    # Everything is ready long before 400 s; only the wake-up at 400 s lets decide train.
    simulator = run(UNIFORM, "async", eta=0, steps=3, min_generate_s=400.0)
    assert simulator.step == 3
    assert simulator.snapshots[1].now >= 400.0 + COST.switch_to_train_s


def test_inflight_limit_below_a_group_is_refused_up_front() -> None:
    # It would stall the run (no group can ever start): the policy refuses it.
    with pytest.raises(ValueError, match="at least group_size"):
        run(UNIFORM, "async", eta=1, max_inflight_rollouts=3)


def test_cost_model_from_mapping_and_decode_rate() -> None:
    cost = CostModel.from_mapping({"peak_tokens_per_s": 1000, "b_half": 9, "kv_dropped_on_switch": 0})
    assert cost.decode_rate(1) == 100.0  # 1000 / (1 + 9)
    assert cost.decode_rate(9) * 9 == 500.0  # half the peak at b_half
    assert cost.kv_dropped_on_switch is False
    assert cost.train_s(1000) == COST.train_step_s + 1000 * COST.train_s_per_token
    with pytest.raises(ValueError, match="unknown cost model fields"):
        CostModel.from_mapping({"tokens_per_s": 1.0})


def test_workloads_are_long_tailed_and_uniform() -> None:
    rng = random.Random(0)
    swe = [len(calls) for _ in range(50) for calls in SWE.draw_group(rng, 4)]
    assert max(swe) > 3 * sorted(swe)[len(swe) // 2]
    assert {len(calls) for calls in UNIFORM.draw_group(rng, 8)} == {UNIFORM.calls_median}
    for calls in SWE.draw_group(rng, 8):
        assert sum(c.prompt_tokens + c.gen_tokens for c in calls) <= SWE.max_context_tokens
        assert calls[-1].tool_s == 0.0


def test_table_lists_every_run_with_its_speedup() -> None:
    results = compare([UNIFORM], FREE_SWITCH, etas=(0, 1), **SMALL)
    table = format_table(results)
    assert [r.mode for r in results] == ["sync", "async", "async"]
    assert table.count("uniform") == 3
    assert "1.00x" in table
