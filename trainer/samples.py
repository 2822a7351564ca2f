"""Samples: one rollout's LLM calls turned into token sequences the trainer can score.

Owns :class:`Sample` and the rule that turns a rollout's :class:`~store.events.LLMCallCompleted`
events into samples (:func:`build_samples`). It does not own rewards or advantages
(``trainer.advantage``), nor the loss (``trainer.policy``); it never tokenizes or renders text:
every token id here is one the proxy recorded.

The merge rule. A multi-turn agent usually re-sends its whole history each call, so call ``k+1``'s
prompt starts with call ``k``'s prompt and response, followed by whatever came since (a tool
result, the next user turn, the chat template's separators). When a call's ``prompt_ids`` start
with exactly the current sample's tokens, the call extends that sample: the new prompt suffix is
appended with ``loss_mask`` 0 and the response with ``loss_mask`` 1. Otherwise (the harness
rewrote, truncated or re-rendered its history: a "prefix break") the call starts a new sample.

Invariant: every response token of every call appears in exactly one sample, with mask 1, its
sampling log-probability and the policy version that sampled it, preceded by exactly the tokens
the engine conditioned on when it sampled it. Prompt tokens carry mask 0, log-prob 0.0, version -1.
(Truncation, below, is the one exception, and the sample records it.)

Truncation. A sample longer than a limit (the trainer's context, a memory budget) cannot be
trained whole. Two rules keep the invariant for every token that *is* trained:

- ``"cut"`` (the default) keeps the head: the first ``max_tokens`` tokens, each still preceded by
  exactly what the engine conditioned on, trained with the rollout's advantage; the tail is
  removed (so not trained). The tail cannot be kept on its own: without its prefix its tokens
  would be scored in a context the policy never saw. This is what verl does to a response longer
  than ``max_response_length``.
- ``"drop"`` keeps nothing: the sample is emptied (no tokens, nothing trained).

Either way ``Sample.truncation`` says what happened and why, e.g.
``"cut: 5000 tokens > max 4096; 812 sampled tokens not trained"``; it is None for a whole sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from store.events import LLMCallCompleted

#: ``Sample.versions`` value of a token the policy did not sample (prompt / rendered tokens).
NOT_SAMPLED = -1

#: What to do with a sample longer than the limit (see the module docstring).
Overflow = Literal["cut", "drop"]
OVERFLOWS: tuple[str, ...] = get_args(Overflow)


@dataclass(frozen=True, slots=True)
class Sample:
    """One token sequence of one rollout, as the model saw and produced it.

    All per-token tuples have the length of ``tokens``; position ``t`` describes ``tokens[t]``.
    """

    rollout: str
    #: The calls merged into this sample, in order.
    call_ids: tuple[str, ...]
    tokens: tuple[int, ...]
    #: 1 on tokens the model sampled (trained on), 0 on prompt / rendered tokens.
    loss_mask: tuple[int, ...]
    #: Sampling log-probability of each sampled token; 0.0 elsewhere.
    logprobs: tuple[float, ...]
    #: Policy version that sampled each token; ``NOT_SAMPLED`` (-1) elsewhere.
    versions: tuple[int, ...]
    #: None for a whole sample; else why and how it was shortened (see the module docstring).
    truncation: str | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        lengths = {"loss_mask": len(self.loss_mask), "logprobs": len(self.logprobs)}
        lengths["versions"] = len(self.versions)
        bad = {name: length for name, length in lengths.items() if length != n}
        if bad:
            raise ValueError(f"sample of rollout {self.rollout!r} has {n} tokens but lengths {bad}")

    @property
    def num_sampled(self) -> int:
        """How many tokens of this sample the model sampled."""
        return sum(self.loss_mask)


class _Builder:
    """A sample under construction: lists that grow as calls are merged in."""

    __slots__ = ("call_ids", "logprobs", "loss_mask", "rollout", "tokens", "versions")

    def __init__(self, rollout: str) -> None:
        self.rollout = rollout
        self.call_ids: list[str] = []
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def extends(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a prompt starts with exactly this sample's tokens (so the call continues it)."""
        n = len(self.tokens)
        return len(prompt_ids) >= n and tuple(prompt_ids[:n]) == tuple(self.tokens)

    def append(self, call: LLMCallCompleted) -> None:
        # Only the part of the prompt the sample does not hold yet is new: for a fresh sample that
        # is the whole prompt, for a continuation the tokens added since the previous response.
        suffix = call.prompt_ids[len(self.tokens) :]
        self.call_ids.append(call.call_id)
        self.tokens.extend(suffix)
        self.loss_mask.extend([0] * len(suffix))
        self.logprobs.extend([0.0] * len(suffix))
        self.versions.extend([NOT_SAMPLED] * len(suffix))
        self.tokens.extend(call.response_ids)
        self.loss_mask.extend([1] * len(call.response_ids))
        self.logprobs.extend(float(x) for x in call.response_logprobs)
        # Per-token versions when the call recorded them (a generation preempted by a weight
        # update continues under the new version), else the call's one version for every token.
        n = len(call.response_ids)
        versions = call.response_versions if len(call.response_versions) == n else (call.policy_version,) * n
        self.versions.extend(int(v) for v in versions)

    def build(self) -> Sample:
        return Sample(
            rollout=self.rollout,
            call_ids=tuple(self.call_ids),
            tokens=tuple(self.tokens),
            loss_mask=tuple(self.loss_mask),
            logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
        )


def _validate(call: LLMCallCompleted) -> None:
    if len(call.response_logprobs) != len(call.response_ids):
        raise ValueError(
            f"call {call.call_id!r} of rollout {call.rollout!r} has {len(call.response_ids)} response "
            f"tokens but {len(call.response_logprobs)} response logprobs; the proxy must record one "
            "sampling logprob per response token"
        )


def truncate_sample(sample: Sample, max_tokens: int, overflow: Overflow = "cut") -> Sample:
    """``sample`` if it has at most ``max_tokens`` tokens, else its head (``"cut"``) or an empty
    sample (``"drop"``), with ``truncation`` saying what happened."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
    n = len(sample.tokens)
    if n <= max_tokens:
        return sample
    if overflow == "drop":
        reason = f"drop: {n} tokens > max {max_tokens}; {sample.num_sampled} sampled tokens not trained"
        return replace(sample, tokens=(), loss_mask=(), logprobs=(), versions=(), truncation=reason)
    lost = sum(sample.loss_mask[max_tokens:])
    reason = f"cut: {n} tokens > max {max_tokens}; {lost} sampled tokens not trained"
    return replace(
        sample,
        tokens=sample.tokens[:max_tokens],
        loss_mask=sample.loss_mask[:max_tokens],
        logprobs=sample.logprobs[:max_tokens],
        versions=sample.versions[:max_tokens],
        truncation=reason,
    )


def build_samples(
    calls: Sequence[LLMCallCompleted], *, max_tokens: int | None = None, overflow: Overflow = "cut"
) -> list[Sample]:
    """Turn ONE rollout's calls, in call order, into samples (see the module docstring).

    With ``max_tokens``, a longer sample is truncated by ``overflow`` (:func:`truncate_sample`).
    Raises ``ValueError`` if the calls belong to several rollouts or a call's logprobs do not
    match its response tokens. No calls give no samples.
    """
    if not calls:
        return []
    rollout = calls[0].rollout
    samples: list[Sample] = []
    current: _Builder | None = None
    for call in calls:
        if call.rollout != rollout:
            raise ValueError(
                f"build_samples() takes one rollout's calls; got {rollout!r} and {call.rollout!r} "
                "(use rollout_samples() for a mix)"
            )
        _validate(call)
        if current is None or not current.extends(call.prompt_ids):
            # A prefix break (or the first call): the previous sample is complete.
            if current is not None:
                samples.append(current.build())
            current = _Builder(rollout)
        current.append(call)
    assert current is not None
    samples.append(current.build())
    if max_tokens is not None:
        samples = [truncate_sample(s, max_tokens, overflow) for s in samples]
    return samples


def rollout_samples(
    calls: Iterable[LLMCallCompleted], *, max_tokens: int | None = None, overflow: Overflow = "cut"
) -> dict[str, list[Sample]]:
    """Samples of each rollout among ``calls`` (several rollouts, interleaved, each in call order).

    The result is keyed by rollout id, in order of each rollout's first call.
    """
    by_rollout: dict[str, list[LLMCallCompleted]] = {}
    for call in calls:
        by_rollout.setdefault(call.rollout, []).append(call)
    return {
        rollout: build_samples(rollout_calls, max_tokens=max_tokens, overflow=overflow)
        for rollout, rollout_calls in by_rollout.items()
    }
