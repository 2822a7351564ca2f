"""The engine contract: token ids in, token ids and log-probabilities out.

Owns the ``Engine`` protocol and its request/result types. An engine knows nothing about chat
templates, tools, rollouts or HTTP: the proxy renders text to tokens and parses tokens back;
the engine samples. Every implementation (the in-process torch engine, the vLLM subprocess)
is held to the same contract tests.

Invariant: every token an engine returns carries the policy version that sampled it, and the
version only changes through ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one completion."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    #: Generation stops after sampling any of these ids (the id itself is returned).
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    #: Also report this many most likely tokens (with log-probs) at each sampled position.
    top_logprobs: int = 0


#: Called on the event loop with each newly sampled token and its log-probability.
TokenCallback = Callable[[int, float], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    #: Streaming: if set, every token is handed over as soon as it is sampled, in order, before
    #: ``generate`` returns the whole result. It must not block.
    on_token: TokenCallback | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateResult:
    token_ids: tuple[int, ...]
    #: log p(token) under the sampling distribution (logits / temperature), one per token.
    logprobs: tuple[float, ...]
    #: "stop" (a stop token was sampled) or "length" (max_tokens reached).
    finish_reason: str
    policy_version: int
    #: Seconds the request waited before its batch started, and seconds of generation.
    queue_s: float = 0.0
    gen_s: float = 0.0
    #: With ``top_logprobs`` > 0: per token, the most likely (id, log-prob) pairs.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@runtime_checkable
class Engine(Protocol):
    """A token-in/token-out generator whose weights the trainer can replace."""

    @property
    def policy_version(self) -> int:
        """The version of the weights now serving."""
        ...

    @property
    def max_context(self) -> int:
        """The longest prompt + completion, in tokens, the engine accepts."""
        ...

    async def start(self) -> None:
        """Load the model and start serving; returns when ``generate`` can be called."""
        ...

    async def close(self) -> None:
        """Stop serving, fail pending requests, release the model. Idempotent."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample one completion. Cancelling the awaiting task cancels the generation."""
        ...

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights between generations and serve ``version`` from now on."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """True between ``sleep`` and the ``wake`` that brings the KV cache back."""
        ...

    async def sleep(self, level: int = 1) -> None:
        """Give the accelerator's memory to the trainer; waits for running generations to end.

        Level 1 frees the KV cache and offloads the weights to host memory; level 2 also
        discards the weights, so ``load_weights`` must follow before serving again.
        ``generate`` raises ``EngineUnavailable`` while the engine sleeps.
        """
        ...

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Bring back what ``sleep`` released: "weights" first (then push new weights if any),
        then "kv_cache"; serving resumes once both are back."""
        ...
