"""build_samples / rollout_samples: how a rollout's calls become token sequences."""

from __future__ import annotations

import random

import pytest

from store.events import LLMCallCompleted
from store.tokens import Tokens
from trainer.samples import NOT_SAMPLED, Sample, build_samples, rollout_samples, truncate_sample


def call(
    call_id: str,
    prompt: list[int],
    response: list[int],
    logprobs: list[float] | None = None,
    *,
    rollout: str = "r1",
    version: int = 0,
) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=0.0,
        rollout=rollout,
        call_id=call_id,
        surface="openai.chat",
        prompt_ids=Tokens(tuple(prompt)),
        response_ids=Tokens(tuple(response)),
        response_logprobs=tuple(logprobs if logprobs is not None else [-0.5] * len(response)),
        policy_version=version,
        finish_reason="stop",
        request={},
        response_text="",
        queue_s=0.0,
        total_s=0.0,
    )


def test_calls_that_extend_merge_into_one_sample() -> None:
    first = call("c1", [1, 2, 3], [4, 5], [-0.1, -0.2], version=0)
    # previous prompt + previous response + a tool result (6, 7), then a new response.
    second = call("c2", [1, 2, 3, 4, 5, 6, 7], [8], [-0.3], version=1)
    [sample] = build_samples([first, second])
    assert sample.rollout == "r1"
    assert sample.call_ids == ("c1", "c2")
    assert sample.tokens == (1, 2, 3, 4, 5, 6, 7, 8)
    assert sample.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1)
    assert sample.logprobs == (0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3)
    assert sample.versions == (-1, -1, -1, 0, 0, -1, -1, 1)
    assert sample.num_sampled == 3


def test_prompt_equal_to_the_sample_merges_with_an_empty_suffix() -> None:
    [sample] = build_samples([call("c1", [1, 2], [3]), call("c2", [1, 2, 3], [4])])
    assert sample.tokens == (1, 2, 3, 4)
    assert sample.loss_mask == (0, 0, 1, 1)


def test_a_prompt_that_rewrites_history_starts_a_new_sample() -> None:
    first = call("c1", [1, 2, 3], [4, 5], [-0.1, -0.2])
    # The harness re-rendered the assistant turn: 9 instead of 4.
    second = call("c2", [1, 2, 3, 9, 5, 6], [7, 8], [-0.3, -0.4], version=2)
    a, b = build_samples([first, second])
    assert (a.call_ids, a.tokens, a.loss_mask) == (("c1",), (1, 2, 3, 4, 5), (0, 0, 0, 1, 1))
    assert b.call_ids == ("c2",)
    assert b.tokens == (1, 2, 3, 9, 5, 6, 7, 8)
    assert b.loss_mask == (0, 0, 0, 0, 0, 0, 1, 1)
    assert b.logprobs == (0.0,) * 6 + (-0.3, -0.4)
    assert b.versions == (NOT_SAMPLED,) * 6 + (2, 2)


def test_a_shorter_prompt_is_a_prefix_break() -> None:
    samples = build_samples([call("c1", [1, 2, 3], [4]), call("c2", [1, 2], [5])])
    assert [s.tokens for s in samples] == [(1, 2, 3, 4), (1, 2, 5)]


def test_only_the_current_sample_is_extended() -> None:
    # c3 continues c1's conversation, but c2 broke the prefix in between: c3 gets its own sample.
    calls = [call("c1", [1], [2]), call("c2", [7], [8]), call("c3", [1, 2, 3], [4])]
    assert [s.call_ids for s in build_samples(calls)] == [("c1",), ("c2",), ("c3",)]


def test_mismatched_logprobs_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"call 'c1' of rollout 'r1' has 2 response tokens but 1"):
        build_samples([call("c1", [1], [2, 3], [-0.1])])


def test_calls_of_several_rollouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="one rollout's calls"):
        build_samples([call("c1", [1], [2]), call("c2", [1, 2], [3], rollout="r2")])


def test_no_calls_no_samples() -> None:
    assert build_samples([]) == []


def test_sample_checks_its_lengths() -> None:
    with pytest.raises(ValueError, match="3 tokens"):
        Sample(
            rollout="r",
            call_ids=(),
            tokens=(1, 2, 3),
            loss_mask=(0, 1),
            logprobs=(0.0,) * 3,
            versions=(-1,) * 3,
        )


def test_rollout_samples_splits_interleaved_rollouts() -> None:
    calls = [
        call("a1", [1], [2], rollout="a"),
        call("b1", [5], [6], rollout="b"),
        call("a2", [1, 2, 3], [4], rollout="a"),
    ]
    grouped = rollout_samples(calls)
    assert list(grouped) == ["a", "b"]
    assert [s.tokens for s in grouped["a"]] == [(1, 2, 3, 4)]
    assert [s.tokens for s in grouped["b"]] == [(5, 6)]


def test_every_sampled_token_appears_once_in_order_with_its_prefix() -> None:
    """The invariant, on random conversations mixing continuations and prefix breaks."""
    rng = random.Random(0)
    for _ in range(50):
        calls: list[LLMCallCompleted] = []
        history: list[int] = []
        for k in range(rng.randint(1, 6)):
            if history and rng.random() < 0.7:
                prompt = history + [rng.randrange(100) for _ in range(rng.randint(0, 3))]
            else:
                prompt = [rng.randrange(100) for _ in range(rng.randint(1, 5))]
            response = [rng.randrange(100) for _ in range(rng.randint(0, 4))]
            logprobs = [-rng.random() for _ in response]
            calls.append(call(f"c{k}", prompt, response, logprobs, version=k))
            history = prompt + response
        samples = build_samples(calls)
        sampled = [
            (tok, lp, v)
            for s in samples
            for tok, m, lp, v in zip(s.tokens, s.loss_mask, s.logprobs, s.versions, strict=True)
            if m
        ]
        expected = [
            (tok, lp, c.policy_version)
            for c in calls
            for tok, lp in zip(c.response_ids, c.response_logprobs, strict=True)
        ]
        assert sampled == expected
        # Each call's response sits right after exactly its prompt in its sample.
        by_call = {cid: s for s in samples for cid in s.call_ids}
        for c in calls:
            tokens = by_call[c.call_id].tokens
            n = len(c.prompt_ids)
            assert tokens[:n] == c.prompt_ids
            assert tokens[n : n + len(c.response_ids)] == c.response_ids


# --- per-token versions and truncation ----------------------------------------------------------


def test_per_token_versions_of_a_preempted_call_are_kept() -> None:
    preempted = LLMCallCompleted(
        ts=0.0,
        rollout="r1",
        call_id="c1",
        surface="openai.chat",
        prompt_ids=Tokens((1, 2)),
        response_ids=Tokens((3, 4, 5)),
        response_logprobs=(-0.1, -0.2, -0.3),
        policy_version=4,
        finish_reason="stop",
        request={},
        response_text="",
        queue_s=0.0,
        total_s=0.0,
        preemptions=1,
        response_versions=Tokens((4, 4, 5)),
    )
    [sample] = build_samples([preempted])
    assert sample.versions == (NOT_SAMPLED, NOT_SAMPLED, 4, 4, 5)


def long_sample() -> Sample:
    # prompt 1 2 3, response 4 5, tool result 6 7, response 8 9: 9 tokens, 4 sampled.
    first = call("c1", [1, 2, 3], [4, 5], [-0.4, -0.5])
    second = call("c2", [1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.8, -0.9], version=1)
    [sample] = build_samples([first, second])
    return sample


def test_a_sample_within_the_limit_is_untouched() -> None:
    sample = long_sample()
    assert truncate_sample(sample, 9) is sample
    assert sample.truncation is None


def test_cut_keeps_the_head_and_records_why() -> None:
    cut = truncate_sample(long_sample(), 8)
    assert cut.tokens == (1, 2, 3, 4, 5, 6, 7, 8)
    assert cut.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1)
    assert cut.logprobs == (0.0, 0.0, 0.0, -0.4, -0.5, 0.0, 0.0, -0.8)
    assert cut.versions == (-1, -1, -1, 0, 0, -1, -1, 1)
    assert cut.call_ids == ("c1", "c2")
    assert cut.truncation == "cut: 9 tokens > max 8; 1 sampled tokens not trained"
    # Cutting inside the tool result loses the whole second response.
    assert (
        truncate_sample(long_sample(), 6).truncation == "cut: 9 tokens > max 6; 2 sampled tokens not trained"
    )
    # Cutting into the prompt leaves nothing to train, but the record stays.
    prompt_only = truncate_sample(long_sample(), 2)
    assert (prompt_only.tokens, prompt_only.num_sampled) == ((1, 2), 0)


def test_drop_empties_the_sample_and_records_why() -> None:
    dropped = truncate_sample(long_sample(), 8, "drop")
    assert (dropped.tokens, dropped.loss_mask, dropped.logprobs, dropped.versions) == ((), (), (), ())
    assert dropped.call_ids == ("c1", "c2")
    assert dropped.truncation == "drop: 9 tokens > max 8; 4 sampled tokens not trained"


def test_build_samples_truncates_after_merging() -> None:
    first = call("c1", [1, 2, 3], [4, 5])
    second = call("c2", [1, 2, 3, 4, 5, 6, 7], [8, 9])
    [sample] = build_samples([first, second], max_tokens=5)
    assert sample.tokens == (1, 2, 3, 4, 5)
    assert sample.truncation is not None and sample.truncation.startswith("cut: 9 tokens > max 5")
    grouped = rollout_samples([first, second], max_tokens=5, overflow="drop")
    assert grouped["r1"][0].tokens == ()


def test_truncation_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        truncate_sample(long_sample(), 0)
    with pytest.raises(ValueError, match="overflow must be one of"):
        truncate_sample(long_sample(), 4, "keep-tail")  # type: ignore[arg-type]
