"""The engine contract: token ids in, token ids and log-probabilities out.

Owns the ``Engine`` protocol and its request/result types. An engine knows nothing about chat
templates, tools, rollouts or HTTP: the proxy renders text to tokens and parses tokens back;
the engine samples. Every implementation (the in-process torch engine, the vLLM subprocess)
is held to the same contract tests.

Invariant: every token an engine returns carries the policy version that sampled it, and the
version only changes through ``load_weights`` or ``load_weight_buckets``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from appliance.engines.constraints import Constraint, check_constraint
from contracts.errors import BadRequest, ContextTooLong
from trainer.buckets import WeightBucket


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one completion."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    #: Sample only from this many most likely tokens (and any tied with the last of them),
    #: renormalised, before top-p; 0, or at least the vocabulary's size: every token (off).
    top_k: int = 0
    #: Generation stops after sampling any of these ids (the id itself is returned).
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    #: Also report this many most likely tokens (with log-probs) at each sampled position.
    top_logprobs: int = 0
    #: The sampled text (before the stop token) must match this grammar
    #: (``appliance.engines.constraints``); log-probs are then those of the masked distribution.
    constraint: Constraint | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SamplingParams:
        """The params ``dataclasses.asdict`` recorded (a call event's ``sampling``); keys this
        version does not know are ignored, missing ones take their defaults (a record made
        before ``top_k`` existed sampled every token, which its default 0 means)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in record.items() if key in known}
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        if "constraint" in values:
            values["constraint"] = Constraint.from_record(values["constraint"])
        return cls(**values)


#: The ranges every engine accepts (each engine checks them; the proxy checks them first).
#: A seed is a signed 64-bit integer, what torch's and vLLM's generators take.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: A temperature is 0 (greedy) or at least this: below it logits / T overflows float32 in the
#: torch engine, and vLLM samples greedily anyway.
MIN_TEMPERATURE = 1e-5
#: The most alternatives reported per token (vLLM's default ``max_logprobs``, OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The smallest top-p an engine samples with. The most likely token has probability >= 1 / vocab,
#: so every top-p below that keeps it alone: raising a smaller one (OpenAI allows 0) to this
#: changes no draw, and keeps float32 from rounding it to 0 (which would cut every token).
MIN_TOP_P = 1e-30


#: Called on the event loop with each newly sampled token and its log-probability.
TokenCallback = Callable[[int, float], None]
#: Called on the event loop with newly sampled tokens and their log-probabilities, in order.
TokensCallback = Callable[[Sequence[int], Sequence[float]], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    #: Streaming: if set, every token is handed over as soon as it is sampled, in order, before
    #: ``generate`` returns the whole result. It must not block.
    on_token: TokenCallback | None = None
    #: With ``on_token``: an engine that receives tokens several at a time (vLLM's stream, whose
    #: reads bring whatever the server has written) may hand each such group over in one call
    #: to this instead (the same tokens in the same order, each handed over once, either way), as
    #: soon as it has them: no token waits for a later one. An engine that does not know it calls
    #: ``on_token`` for each token.
    on_tokens: TokensCallback | None = None
    #: Which calls belong together (the proxy sets the rollout id): an engine made of replicas
    #: (``appliance.engines.fleet``) sends every call with the same key to the same replica,
    #: whose prefix cache holds the earlier turns. None: no affinity. One engine ignores it.
    affinity: str | None = None
    #: Also score the prompt (``/completions`` with ``echo`` and ``logprobs``): None, not wanted;
    #: k >= 0, the log-prob of each prompt token given the ones before it (the first has none)
    #: under the model's raw distribution (temperature 1, no top-p, no constraint), and its k
    #: most likely alternatives.
    prompt_logprobs: int | None = None
    #: Nonzero: the prompt holds only ids a tokenizer with a vocabulary of this size produced and
    #: ids this model sampled (the proxy's chat prompts). An engine whose vocabulary is at least
    #: this large then skips checking every prompt id, a scan as long as the conversation.
    tokenizer_vocab: int = 0
    #: ``prompt_ids`` as a JSON array, where the caller keeps it (the proxy's renderer writes
    #: each turn's ids once): an engine that sends the prompt as JSON sends these bytes instead
    #: of writing the whole conversation again. They must be ``orjson.dumps(list(prompt_ids))``.
    prompt_json: bytes | None = None
    #: With ``on_token``: the caller needs the tokens in order but not each one as soon as it is
    #: sampled (the proxy's calls that answer whole, which follow their tokens only so that a
    #: call preempted by a switch keeps what it sampled). An engine may then hand them over in
    #: batches of up to this many (the first token alone, the last batch when it ends); a
    #: preemption loses the tokens not handed over yet (fewer than this many), which the call
    #: samples again after the switch.
    token_batch: int = 1
    #: With ``token_batch`` > 1: how long, in seconds, a token may wait for the rest of its batch
    #: (a streaming client's: the engine's pace decides how many tokens make a batch, so that a
    #: slow generation still hands over each token as it comes); 0: no bound (the batch's size
    #: alone decides).
    batch_wait_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateResult:
    token_ids: tuple[int, ...]
    #: log p(token) under the sampling distribution (logits / temperature), one per token:
    #: the whole tempered distribution, before any top-k or top-p cut (the torch engine always;
    #: vLLM as its ``--logprobs-mode`` allows, see ``appliance.engines.vllm_engine``).
    logprobs: tuple[float, ...]
    #: "stop" (a stop token was sampled) or "length" (max_tokens reached).
    finish_reason: str
    policy_version: int
    #: Seconds the request waited before its batch started, and seconds of generation.
    queue_s: float = 0.0
    gen_s: float = 0.0
    #: With ``top_logprobs`` > 0: per token, the most likely (id, log-prob) pairs.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    #: With ``prompt_logprobs`` set: one entry per prompt token, its log-prob (None for the
    #: first) and its ``prompt_logprobs`` most likely (id, log-prob) pairs (none for the first).
    #: Empty when not asked for.
    prompt_logprobs: tuple[float | None, ...] = ()
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _token_ids_in(ids: Sequence[int], vocab_size: int) -> bool:
    """Whether every id is an integer (not a bool) in [0, vocab_size). A prompt of plain ints (the
    proxy's, every call) is checked by C loops alone: it is as long as the conversation."""
    if not set(map(type, ids)) <= {int} and not all(map(_is_int, ids)):
        return False
    return min(ids) >= 0 and max(ids) < vocab_size


def validate_request(request: GenerateRequest, *, max_context: int, vocab_size: int) -> None:
    """The contract's checks on one request, which every engine makes before it queues or sends
    anything, so that a value an engine would refuse or fail on (a seed its generator cannot
    take, a non-finite temperature, more top log-probs than vLLM's ``max_logprobs``) is a
    ``BadRequest`` naming the parameter, never a lost or failed batch."""
    params, prompt = request.params, request.prompt_ids
    if not prompt:
        raise BadRequest("the prompt is empty: send at least one token", param="prompt")
    if not _is_int(params.max_tokens) or params.max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {params.max_tokens!r}", param="max_tokens")
    if len(prompt) + params.max_tokens > max_context:
        raise ContextTooLong(
            prompt_tokens=len(prompt), completion_tokens=params.max_tokens, max_context=max_context
        )
    vouched = 0 < request.tokenizer_vocab <= vocab_size
    if not vouched and not _token_ids_in(prompt, vocab_size):
        raise BadRequest(f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
    temperature = params.temperature
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise BadRequest(f"temperature must be >= 0, got {temperature!r}", param="temperature")
    if 0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature!r}",
            param="temperature",
        )
    if not (_is_number(params.top_p) and 0 < params.top_p <= 1):
        raise BadRequest(f"top_p must lie in (0, 1], got {params.top_p!r}", param="top_p")
    # No upper bound: a top_k at least the vocabulary's size keeps every token, like 0.
    if not (_is_int(params.top_k) and params.top_k >= 0):
        raise BadRequest(f"top_k must be an integer >= 0 (0: off), got {params.top_k!r}", param="top_k")
    seed = params.seed
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise BadRequest(
            f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {seed!r}", param="seed"
        )
    if not (_is_int(params.top_logprobs) and 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS):
        raise BadRequest(
            f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs!r}",
            param="top_logprobs",
        )
    # Ids outside the vocabulary are allowed: no token equals them (the contract's way to say
    # "never stop"), so they only have to be integers.
    if not all(map(_is_int, params.stop_token_ids)):
        raise BadRequest("stop_token_ids must be integers", param="stop_token_ids")
    check_constraint(params.constraint)
    wanted = request.prompt_logprobs
    if wanted is not None and not (_is_int(wanted) and 0 <= wanted <= MAX_TOP_LOGPROBS):
        raise BadRequest(
            f"prompt_logprobs must be None or lie in [0, {MAX_TOP_LOGPROBS}], got {wanted!r}",
            param="logprobs",
        )


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

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """Replace the weights from a stream of buckets (consumed in order, each one fully used before the
        next is awaited) between generations; serve `version` from now on once the last bucket is in.
        Every parameter of the model must be covered exactly (a tied lm_head may be left out), else
        BadRequest and the old version keeps being served where the engine can guarantee that."""
        ...

    @property
    def needs_weights(self) -> bool:
        """True when the engine is up but serves nothing until weights are pushed again (it lost
        a version that only a bucketed push had, e.g. a restarted server, or a push failed
        half-way); the scheduler then pushes the published version."""
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


@runtime_checkable
class WeightGroupMember(Protocol):
    """An engine that can take a push broadcast over a process group (``trainer.weight_group``):
    buckets with ``via_group`` instead of files. Only engines in other processes can (vLLM)."""

    @property
    def in_weight_group(self) -> bool:
        """Whether every worker is in a weight group now (a restart leaves it)."""
        ...

    @property
    def weight_group_members(self) -> int:
        """How many members the engine brings to a group (its workers)."""
        ...

    async def join_weight_group(self, spec: Mapping[str, Any], rank_offset: int = 1) -> None:
        """Join the group ``spec`` describes as ranks ``rank_offset`` and up, while the trainer
        hosts it; returns once the group has formed."""
        ...
