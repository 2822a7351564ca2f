"""The scheduling simulator: it finishes, conserves tokens, is deterministic, and predicts what
the scheduling modes promise (async no slower, faster on long tails, staleness within eta; split
free of switches, paying a push per step, and ahead of collocated when switches are dear)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from appliance.scheduler.decide import Mode, SchedulePolicy
from appliance.scheduler.simulate import (
    SWE,
    UNIFORM,
    Breakdown,
    CostModel,
    Layout,
    SimResult,
    Simulator,
    Workload,
    compare,
    compare_placements,
    format_breakdown,
    format_placements,
    format_table,
    simulate,
)

COST = CostModel()
FREE_SWITCH = replace(COST, switch_to_train_s=0.0, switch_to_generate_s=0.0)
SMALL: dict[str, Any] = {"batch_groups": 2, "group_size": 4, "steps": 6, "warmup": 1}


def run(
    workload: Workload,
    mode: Mode,
    eta: int = 0,
    steps: int = 7,
    min_generate_s: float = 0.0,
    max_inflight_rollouts: int | None = None,
    layout: Layout | None = None,
    cost: CostModel = COST,
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
    simulator = Simulator(policy, cost, workload, seed=3, layout=layout)
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


# --- split placement and several GPUs ------------------------------------------------------------

EIGHT = Layout(gpus=8, split=4)
#: The same machine, split with the engine as two replicas of two GPUs each.
EIGHT_TP2 = Layout(gpus=8, split=4, replicas=2)


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("workload", [SWE, UNIFORM])
def test_split_reaches_its_steps_within_the_staleness_bound(workload: Workload, eta: int) -> None:
    simulator = run(workload, "split", eta, steps=8, layout=EIGHT)
    assert simulator.step == 8 and simulator.stop_reason == "reached step 8"
    assert max(staleness(simulator)) <= eta
    result = simulator.result(warmup=1)
    assert result.max_sampled_staleness <= eta and result.masked_fraction == 0.0
    for group in simulator.groups:
        assert group.index // 2 - group.admitted_version <= eta


@pytest.mark.parametrize(
    ("layout", "mode", "replicas", "gpus_each"),
    [(EIGHT, "split", 4, 1), (EIGHT_TP2, "split", 2, 2), (Layout(gpus=8, replicas=2), "async", 2, 4)],
)
def test_replicas_conserve_tokens(layout: Layout, mode: Mode, replicas: int, gpus_each: int) -> None:
    """Preemption at pushes (split) or switches, on several replicas, loses or adds no token."""
    simulator = run(SWE, mode, eta=2, layout=layout)
    assert [r.gpus for r in simulator.replicas] == [gpus_each] * replicas
    finished = [r for g in simulator.groups for r in g.rollouts if id(r) not in simulator.running]
    assert len({id(r.replica) for r in finished}) == replicas  # every replica served some
    for rollout in finished:
        assert math.isclose(sum(rollout.sampled.values()), sum(c.gen_tokens for c in rollout.calls))
        assert math.isclose(rollout.context, sum(c.prompt_tokens + c.gen_tokens for c in rollout.calls))


class _Watched(Simulator):
    """Counts what happens beside a step: seconds decoding while a step trains, and groups
    admitted while one runs."""

    decoding_beside_s = 0.0
    admitted_beside = 0

    def _advance(self, t: float) -> None:
        stepping = self.trainer_busy or self.phase in ("to_train", "train")
        if stepping and self.phase == "generate" and any(r.decoding for r in self.replicas):
            self.decoding_beside_s += t - self.now
        super()._advance(t)

    def _admit_group(self) -> None:
        if self.stepping or self.phase != "generate":
            self.admitted_beside += 1
        super()._admit_group()


@pytest.mark.parametrize(("mode", "beside"), [("split", True), ("async", False)])
def test_split_generates_and_admits_beside_the_step(mode: Mode, beside: bool) -> None:
    """Split decodes while the training GPUs train and admits groups meanwhile (decide is
    consulted beside the step); collocated async does neither."""
    policy = SchedulePolicy(batch_groups=2, group_size=4, max_steps=8, mode=mode, eta=2)
    simulator = _Watched(policy, COST, SWE, seed=3, layout=EIGHT)
    simulator.run()
    assert simulator.step == 8
    assert (simulator.decoding_beside_s > 0) is beside
    assert (simulator.admitted_beside > 0) is beside


def test_split_pays_pushes_not_switches() -> None:
    """Switch costs do not touch split; each step pauses generation push_s instead."""
    dear = replace(COST, switch_to_train_s=300.0, switch_to_generate_s=300.0)
    cheap = simulate(UNIFORM, COST, mode="split", eta=1, layout=EIGHT, **SMALL)
    assert simulate(UNIFORM, dear, mode="split", eta=1, layout=EIGHT, **SMALL) == cheap
    assert math.isclose(cheap.switch_fraction * cheap.seconds_per_step, COST.push_s)
    free = simulate(UNIFORM, replace(COST, push_s=0.0), mode="split", eta=1, layout=EIGHT, **SMALL)
    assert free.switch_fraction == 0.0 and free.seconds_per_step < cheap.seconds_per_step


#: Eight groups of eight per step: enough rollouts for eight GPUs.
WIDE: dict[str, Any] = {"batch_groups": 8, "group_size": 8, "steps": 6, "warmup": 1}


def test_split_beats_collocated_when_switches_are_dear() -> None:
    dear = replace(COST, switch_to_train_s=60.0, switch_to_generate_s=60.0)
    for workload in (SWE, UNIFORM):
        collocated = simulate(workload, dear, mode="async", eta=1, layout=EIGHT, **WIDE)
        split = simulate(workload, dear, mode="split", eta=1, layout=EIGHT, **WIDE)
        assert split.seconds_per_step < 0.9 * collocated.seconds_per_step


def test_collocated_beats_split_when_training_dominates_a_small_training_pool() -> None:
    """Six GPUs generate, two train a heavy step: split waits on its training GPUs, which are
    busy nearly all the time, while collocated trains on all eight."""
    heavy = replace(COST, train_s_per_token=6e-4)
    layout = Layout(gpus=8, split=6)
    collocated = simulate(UNIFORM, heavy, mode="async", eta=1, layout=layout, **WIDE)
    split = simulate(UNIFORM, heavy, mode="split", eta=1, layout=layout, **WIDE)
    assert collocated.seconds_per_step < 0.8 * split.seconds_per_step
    assert split.train_fraction > 0.9


def test_more_gpus_and_wider_replicas_are_faster() -> None:
    one = simulate(UNIFORM, COST, mode="sync", **SMALL)
    eight = simulate(UNIFORM, COST, mode="sync", layout=Layout(gpus=8), **SMALL)
    assert eight.seconds_per_step < one.seconds_per_step
    assert (eight.gpus, eight.gen_gpus, eight.train_gpus, eight.replicas) == (8, 8, 8, 8)
    # One GPU alone against one replica on two GPUs (tensor parallel): 2 ** tp_exponent faster.
    narrow = simulate(UNIFORM, FREE_SWITCH, mode="sync", **SMALL)
    wide = simulate(UNIFORM, FREE_SWITCH, mode="sync", layout=Layout(gpus=2, replicas=1), **SMALL)
    assert wide.seconds_per_step < narrow.seconds_per_step
    assert wide.replicas == 1


def test_cost_model_scales_with_gpus() -> None:
    cost = replace(COST, tp_exponent=0.5, train_exponent=1.0)
    assert cost.replica_speed(1) == 1.0 and cost.replica_speed(4) == 2.0
    assert cost.train_s(1000, gpus=4) == cost.train_s(1000) / 4
    assert CostModel.from_mapping({"kv_dropped_on_push": 0, "push_s": 2}).kv_dropped_on_push is False


@pytest.mark.parametrize(
    ("layout", "mode", "message"),
    [
        (Layout(gpus=1), "split", "split mode needs GPUs that generate and GPUs that train"),
        (Layout(gpus=8, split=8), "split", "split mode needs"),
        (Layout(gpus=8, split=0), "split", "split mode needs"),
        (Layout(gpus=8, split=4, replicas=3), "split", "4 generating GPUs do not make 3 equal"),
        (Layout(gpus=6, replicas=4), "async", "6 generating GPUs do not make 4 equal"),
    ],
)
def test_layouts_that_cannot_work_are_refused(layout: Layout, mode: Mode, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(UNIFORM, mode, eta=1, layout=layout)


def test_placement_table_lists_collocated_and_split_side_by_side() -> None:
    results = compare_placements([UNIFORM], COST, EIGHT_TP2, etas=(1,), **SMALL)
    assert [(r.mode, r.gen_gpus, r.train_gpus, r.replicas) for r in results] == [
        ("sync", 8, 8, 2),
        ("async", 8, 8, 2),
        ("split", 4, 4, 2),
    ]
    table = format_placements(results)
    assert "4+4" in table and "2x2" in table and "2x4" in table and "1.00x" in table
    assert simulate(SWE, COST, mode="split", eta=1, layout=EIGHT, **SMALL) == simulate(
        SWE, COST, mode="split", eta=1, layout=EIGHT, **SMALL
    )


# --- where the time goes -------------------------------------------------------------------------


def breakdown(result: SimResult) -> Breakdown:
    assert result.breakdown is not None
    return result.breakdown


@pytest.mark.parametrize(("mode", "eta"), [("sync", 0), ("async", 1), ("async", 2)])
def test_collocated_steps_are_generation_switches_and_training(mode: Mode, eta: int) -> None:
    """Collocated, the machine serves, switches or trains: the three add up to each step."""
    result = simulate(SWE, COST, mode=mode, eta=eta, **SMALL)
    b = breakdown(result)
    assert b.generate + b.pause + b.train == pytest.approx(result.seconds_per_step)
    assert 0.0 <= b.idle <= b.generate
    assert 0.0 <= b.order_wait <= b.generate


@pytest.mark.parametrize("eta", [1, 2])
def test_split_steps_are_generation_and_pushes(eta: int) -> None:
    """Split, generation stops only for the pushes; the step runs beside it."""
    result = simulate(SWE, COST, mode="split", eta=eta, layout=Layout(gpus=2, split=1), **SMALL)
    b = breakdown(result)
    assert b.generate + b.pause == pytest.approx(result.seconds_per_step)
    assert b.pause == pytest.approx(COST.push_s)
    assert 0.0 < b.train < result.seconds_per_step


def test_sync_critical_rollout_is_never_held_and_sets_the_step() -> None:
    """Sync: nothing runs across a switch, so the critical rollout is never held, and the
    generation phase is exactly its life; the floor is the step itself."""
    result = simulate(SWE, COST, mode="sync", **SMALL)
    b = breakdown(result)
    assert b.critical_held == 0.0
    assert b.critical_served == pytest.approx(b.critical)
    assert b.generate == pytest.approx(b.critical)
    assert b.order_wait == 0.0  # a batch is trained as soon as it is ready
    assert b.floor("sync", 0) == pytest.approx(result.seconds_per_step)


@pytest.mark.parametrize("eta", [1, 2])
def test_async_critical_rollouts_wait_through_steps_and_tools_fit_their_life(eta: int) -> None:
    """Async on long tails: the critical rollout lives across steps (held mid-call while the
    machine trains), and its tool time and held time fit in its life."""
    b = breakdown(simulate(SWE, COST, mode="async", eta=eta, **SMALL))
    assert b.critical_held > 0.0
    assert b.critical_tool + b.critical_held <= b.critical + 1e-6
    assert b.critical_served < b.critical
    assert b.order_wait > 0.0  # younger batches ready while an older straggler runs


def test_reprefill_counts_the_dropped_cache_and_vanishes_when_it_is_kept() -> None:
    """Re-prefill is the prefill of what switches dropped: none when the cache is kept, and
    never more tokens than were dropped."""
    dropped = run(SWE, "async", 1, steps=12).meter  # over the whole run: a window shifts them
    kept = run(SWE, "async", 1, steps=12, cost=replace(COST, kv_dropped_on_switch=False)).meter
    assert 0.0 < dropped.reprefill * COST.prefill_tokens_per_s <= dropped.dropped_kv * (1 + 1e-9)
    assert kept.dropped_kv == kept.reprefill == 0.0


def test_floor_formulas() -> None:
    """Collocated: the step, the switches and the critical rollout's serving time spread over
    eta + 1 generation phases; split: its whole life plus a step, over eta + 1 periods, and
    never under a step and its push."""
    b = Breakdown(
        generate=0.0,
        idle=0.0,
        reprefill=0.0,
        order_wait=0.0,
        pause=20.0,
        train=100.0,
        critical=700.0,
        critical_tool=500.0,
        critical_held=100.0,
        critical_served=600.0,
    )
    assert b.floor("sync", 3) == 720.0  # sync is eta 0 whatever the policy says
    assert b.floor("async", 1) == 420.0
    assert b.floor("async", 2) == 320.0
    assert b.floor("split", 1) == 410.0
    assert b.floor("split", 20) == 120.0


def test_breakdown_table_lists_every_run() -> None:
    results = compare([SWE], COST, etas=(1,), **SMALL)
    lines = format_breakdown(results).splitlines()
    assert lines[0].split()[:6] == ["workload", "gpus", "mode", "eta", "s/step", "floor"]
    assert [line.split()[2] for line in lines[2:]] == ["sync", "async"]
    assert lines[3].split()[3] == "1"
