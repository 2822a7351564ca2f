"""Fitting the simulator to a live run: each figure is read back from events made to have it,
the recorded rollouts replay call by call, and a replayed run takes what its rollouts take."""

from __future__ import annotations

import random

import pytest

from appliance.scheduler.decide import SchedulePolicy
from appliance.scheduler.simulate import CostModel, Simulator
from appliance.scheduler.simulate.calibrate import (
    RecordedRollouts,
    fit_cost,
    fit_decode,
    fit_prefill,
    fit_switches,
    fit_train,
    measure_run,
    recorded_rollouts,
)
from appliance.scheduler.simulate.workloads import Call
from store.events import (
    Event,
    LLMCallCompleted,
    RolloutCreated,
    RolloutFinished,
    SwitchPhaseCompleted,
    TrainStepCompleted,
)
from store.tokens import Tokens


def call(
    rollout: str, start: float, *, prompt: int, tokens: int, ttft: float, decode_s: float
) -> LLMCallCompleted:
    """A call that started at ``start``, got its first token ``ttft`` later and decoded its
    other ``tokens - 1`` tokens in ``decode_s``."""
    total = ttft + decode_s
    return LLMCallCompleted(
        ts=start + total,
        rollout=rollout,
        call_id=f"{rollout}@{start}",
        surface="openai.chat",
        prompt_ids=Tokens(tuple(range(prompt))),
        response_ids=Tokens(tuple(range(tokens))),
        response_logprobs=(0.0,) * tokens,
        policy_version=0,
        finish_reason="length",
        request={},
        response_text="",
        queue_s=0.0,
        total_s=total,
        ttft_s=ttft,
    )


def switch(step: int, t0: float, train_s: float, tokens: int = 100) -> tuple[list[Event], float]:
    """One collocated step's switch starting at ``t0``: its phases one after another (0.1 s before
    the step, 0.2 s after it), the step in between; returns them and when the switch ends."""
    events: list[Event] = []
    t = t0
    for phase, seconds in (("drain", 0.05), ("sleep", 0.03), ("onload", 0.02), ("train", train_s),
                           ("offload", 0.1), ("wake_weights", 0.05), ("push", 0.05)):  # fmt: skip
        t += seconds
        events.append(SwitchPhaseCompleted(ts=t, step=step, phase=phase, duration_s=seconds))
        if phase == "train":
            events.append(
                TrainStepCompleted(
                    ts=t, step=step, rollouts=(), samples=8, tokens=tokens, zero_variance_groups=0
                )
            )
    return events, t


def alive(rollouts: list[str], start: float, end: float) -> list[Event]:
    """``rollouts`` admitted at ``start`` and finished at ``end``."""
    return [
        e
        for r in rollouts
        for e in (
            RolloutCreated(
                ts=start, rollout=r, task_id="t", group="g", task={}, policy_version=0, adapter="a"
            ),
            RolloutFinished(ts=end, rollout=r, status="finished"),
        )
    ]


def test_decode_is_read_back_from_calls_at_several_batch_sizes_and_rollouts_alive() -> None:
    peak, b_half, per_rollout = 400.0, 6.0, 0.002
    events: list[Event] = []
    for b, idle, start in ((1, 0, 0.0), (2, 3, 100.0), (4, 1, 200.0), (8, 6, 300.0)):
        per_token = (b + b_half) / peak + per_rollout * (b + idle)  # seconds per token of each
        decoding = [f"r{b}-{i}" for i in range(b)]
        events += [call(r, start, prompt=10, tokens=11, ttft=0.01, decode_s=10 * per_token) for r in decoding]
        # Alive over the whole window: the decoding rollouts, and ``idle`` ones in their tools.
        events += alive(decoding + [f"t{b}-{i}" for i in range(idle)], start - 1, start + 50)
    assert fit_decode([events]) == pytest.approx((peak, b_half, per_rollout), rel=1e-6)


def test_one_batch_size_gives_the_rate_at_that_size() -> None:
    calls: list[Event] = [call(f"r{i}", 0.0, prompt=10, tokens=11, ttft=0.01, decode_s=1.0) for i in range(3)]
    peak, b_half, per_rollout = fit_decode([calls])
    assert per_rollout == 0.0
    assert 1 / CostModel(peak_tokens_per_s=peak, b_half=b_half).decode_rate(3) == pytest.approx(0.1)


def test_the_rollouts_alive_slow_the_simulated_decoding() -> None:
    cost = CostModel(peak_tokens_per_s=100.0, b_half=0.0, rollout_token_s=0.01)
    assert cost.decode_rate(1) == pytest.approx(100.0)  # no rollout counted: the curve alone
    assert cost.decode_rate(1, alive=5) == pytest.approx(1 / (0.01 + 0.05))
    assert CostModel(peak_tokens_per_s=100.0, b_half=0.0).decode_rate(1, alive=5) == 100.0


def test_prefill_counts_the_uncontended_calls_and_whole_prompts_without_a_cache() -> None:
    fast = [call(f"f{i}", 10.0 * i, prompt=100, tokens=2, ttft=0.01, decode_s=0.1) for i in range(2)]
    slow = [call(f"s{i}", 10.0 * i, prompt=100, tokens=2, ttft=1.0, decode_s=0.1) for i in range(6)]
    assert fit_prefill([[*fast, *slow]], cached_between_calls=False) == pytest.approx(100 / 0.01)
    # A second call of one rollout: 100 + 2 tokens of context held, 10 new.
    again = [fast[0], call("f0", 5.0, prompt=112, tokens=2, ttft=0.001, decode_s=0.1)]
    assert fit_prefill([again], cached_between_calls=True) == pytest.approx(10 / 0.001)
    assert fit_prefill([again], cached_between_calls=False) == pytest.approx(112 / 0.001)


def test_training_is_a_line_in_tokens_and_a_falling_one_its_mean() -> None:
    events = [
        e
        for s, tokens in enumerate((100, 200, 400), 1)
        for e in switch(s, 10.0 * s, 1 + 0.01 * tokens, tokens)[0]
    ]
    assert fit_train([events]) == pytest.approx((1.0, 0.01))
    falling = [
        e for s, tokens in enumerate((100, 200), 1) for e in switch(s, 10.0 * s, 3 - 0.01 * tokens, tokens)[0]
    ]
    assert fit_train([falling]) == pytest.approx((1.5, 0.0))


def test_switches_are_the_phases_before_and_after_each_step() -> None:
    events = [e for s in (1, 2) for e in switch(s, 10.0 * s, 1.0)[0]]
    assert fit_switches([events]) == pytest.approx((0.1, 0.2))
    # Runs pooled, their steps apart; the warm-up's left out.
    slow_first = switch(1, 0.0, 1.0)[0] + switch(2, 10.0, 1.0)[0]
    slow_first[0] = SwitchPhaseCompleted(ts=0.05, step=1, phase="drain", duration_s=5.05)
    assert fit_switches([events, slow_first], warmup=1) == pytest.approx((0.1, 0.2))
    assert fit_switches([events, slow_first])[0] == pytest.approx((0.1 * 3 + 5.1) / 4)


def test_a_run_is_measured_between_the_ends_of_training_after_the_warmup() -> None:
    # Step s: generate 2 s, then its switch (0.1 + train 1.0 + 0.2 s).
    events: list[Event] = []
    t = 0.0
    for step in (1, 2, 3):
        switched, t = switch(step, t + 2.0, 1.0)
        events += switched
    measured = measure_run(events, warmup=1)
    assert measured.steps == 2
    assert measured.seconds_per_step == pytest.approx(3.3)
    assert (measured.generate, measured.switch, measured.train) == pytest.approx((2.0, 0.3, 1.0))
    with pytest.raises(ValueError, match="only 3 steps"):
        measure_run(events, warmup=3)


def two_groups() -> list[Event]:
    """Groups g0 and g1 of two rollouts each, and a validation rollout; r0 calls twice."""
    events: list[Event] = []
    for group, rollouts in (("g0", ("r0", "r1")), ("g1", ("r2", "r3"))):
        events += [
            RolloutCreated(
                ts=0.0, rollout=r, task_id="t", group=group, task={}, policy_version=0, adapter="python"
            )
            for r in rollouts
        ]
    events.append(
        RolloutCreated(
            ts=0.0,
            rollout="v0",
            task_id="t",
            group="v",
            task={},
            policy_version=0,
            adapter="python",
            purpose="validation",
        )
    )
    events += [
        call("r0", 0.5, prompt=40, tokens=10, ttft=0.1, decode_s=0.9),  # ends at 1.5
        call("r0", 2.0, prompt=40 + 10 + 7, tokens=5, ttft=0.1, decode_s=0.4),  # 0.5 s of tools; ends at 2.5
        call("r1", 0.5, prompt=40, tokens=10, ttft=0.1, decode_s=0.9),
        call("r2", 0.5, prompt=40, tokens=10, ttft=0.1, decode_s=0.9),
        call("r3", 0.5, prompt=40, tokens=10, ttft=0.1, decode_s=0.9),
        call("v0", 0.5, prompt=40, tokens=10, ttft=0.1, decode_s=0.9),
    ]
    events += [RolloutFinished(ts=2.75, rollout="r0", status="finished")]
    events += [RolloutFinished(ts=1.5, rollout=r, status="finished") for r in ("r1", "r2", "r3")]
    return events


def calls(rollout: tuple[Call, ...]) -> list[tuple[int, int, object]]:
    return [(c.prompt_tokens, c.gen_tokens, c.tool_s) for c in rollout]


def test_recorded_rollouts_are_the_runs_own_calls_by_group_in_admission_order() -> None:
    recorded = recorded_rollouts(two_groups())
    assert len(recorded.groups) == 2  # the validation rollout is left out
    r0, r1 = recorded.groups[0]
    # The harness's start-up (no token sampled), then each call: new prompt tokens, sampled
    # tokens, the harness's time after it (tools, then the wrap-up); a call's time to its first
    # token is the harness's (the proxy's) but for its prefill, here not known: all of it.
    assert calls(r0) == [
        (0, 0, pytest.approx(0.6)),
        (40, 10, pytest.approx(0.6)),
        (7, 5, pytest.approx(0.25)),
    ]
    assert calls(r1) == [(0, 0, pytest.approx(0.6)), (40, 10, 0.0)]
    # At 400 tokens/s the first call's 40 tokens took its whole 0.1 s; the second's 7, 0.0175 s.
    r0, _ = recorded_rollouts(two_groups(), prefill_tokens_per_s=400).groups[0]
    assert calls(r0) == [
        (0, 0, pytest.approx(0.5)),
        (40, 10, pytest.approx(0.5825)),
        (7, 5, pytest.approx(0.25)),
    ]
    source = recorded.fresh()
    rng = random.Random(0)
    assert [source.draw_group(rng, 2) for _ in range(3)] == [
        list(recorded.groups[0]),
        list(recorded.groups[1]),
        list(recorded.groups[0]),  # past the recorded groups: from the first again
    ]
    assert recorded.fresh().draw_group(rng, 2) == list(recorded.groups[0])
    with pytest.raises(ValueError, match="recorded groups have 2 rollouts"):
        recorded.fresh().draw_group(rng, 4)


def test_the_harness_time_before_its_first_call_and_after_its_last_delays_its_group() -> None:
    """Sync over one group: the step waits for the rollout's start-up and its wrap-up."""
    cost = CostModel(
        peak_tokens_per_s=100.0,
        b_half=0.0,
        prefill_tokens_per_s=1e9,
        train_step_s=1.0,
        train_s_per_token=0.0,
        switch_to_train_s=0.0,
        switch_to_generate_s=0.0,
    )
    policy = SchedulePolicy(batch_groups=1, group_size=1, max_steps=3, mode="sync")

    def seconds_per_step(start_up: float, wrap_up: float) -> float:
        calls = (Call(0, 0, start_up), Call(10, 100, 0.5), Call(10, 100, wrap_up))
        simulator = Simulator(policy, cost, RecordedRollouts("one", ((calls,),)))
        simulator.run()
        return simulator.result(1).seconds_per_step

    # Two calls of 100 tokens alone at 100 tokens/s, 0.5 s of tools, the step.
    assert seconds_per_step(0.0, 0.0) == pytest.approx(1 + 0.5 + 1 + 1.0)
    assert seconds_per_step(0.0, 2.0) == pytest.approx(1 + 0.5 + 1 + 2.0 + 1.0)
    assert seconds_per_step(0.7, 2.0) == pytest.approx(0.7 + 1 + 0.5 + 1 + 2.0 + 1.0)


def test_the_cost_model_is_fitted_from_every_run_pooled() -> None:
    events = two_groups() + switch(1, 3.0, 1.0)[0] + switch(2, 10.0, 1.0)[0]
    cost = fit_cost([events])
    assert (cost.switch_to_train_s, cost.switch_to_generate_s) == pytest.approx((0.1, 0.2))
    assert (cost.train_step_s, cost.train_s_per_token) == pytest.approx((1.0, 0.0))
    assert cost.kv_dropped_on_switch
