"""Event types: the vocabulary of the log.

Owns the frozen dataclasses that are appended to the store, their registry (type name -> class)
and their schema versions. It does not own how events are encoded (``store.codec``) or stored
(``store.eventstore``), nor what state they fold into (``store.projections``).

Invariant: an event, once appended, never changes. A new field gets a default; a changed meaning
gets a new ``version`` and an upcaster next to the class, so old logs still replay.

Token ids are ``store.tokens.Tokens`` (one block of int32s; made from any sequence of ints given)
and log-probabilities ``tuple[float, ...]``; the codec packs every field annotated with
:data:`TokenIds` or :data:`Floats` as binary, never as JSON lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

from store.tokens import EMPTY, Tokens

#: A token-id field: given as any sequence of ints, held as ``Tokens`` (see ``LLMCallCompleted``).
TokenIds: TypeAlias = Tokens
Floats: TypeAlias = tuple[float, ...]
JsonObject: TypeAlias = dict[str, Any]

EVENT_TYPES: dict[str, type[Event]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every event. ``type`` and ``version`` identify the schema of the payload."""

    type: ClassVar[str] = "Event"
    version: ClassVar[int] = 1
    #: Seconds since the epoch at which the event was created (not when it became durable).
    ts: float

    def __init_subclass__(cls, group: bool = False, **kwargs: Any) -> None:
        # Not bare ``super()``: its ``__class__`` cell names the class ``dataclass(slots=True)``
        # discarded, which the subclasses of the final ``Event`` do not derive from.
        super(Event, cls).__init_subclass__(**kwargs)
        if group:  # fields that events share, not an event of its own: not registered
            return
        name = cls.__dict__.get("type", cls.__name__)
        existing = EVENT_TYPES.get(name)
        # ``dataclass(slots=True)`` builds a second class with the same qualified name: that one
        # replaces the first. Any other clash is a programming error.
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise TypeError(f"event type {name!r} is registered twice")
        cls.type = name
        EVENT_TYPES[name] = cls

    @property
    def rollout_id(self) -> str | None:
        """The rollout this event belongs to, or None for run-level events."""
        value = getattr(self, "rollout", None)
        return value if isinstance(value, str) else None


# --- field groups ------------------------------------------------------------------------------
# Fields that several events share, each group defined once: an ``Event`` subclass made with
# ``group=True`` (never registered nor logged) and no slots of its own (the event's
# ``slots=True`` makes them). An event lists its groups as its bases, the group whose fields come
# last first: its fields are ``ts``, the groups' in that order, then its own. That order is the
# order of the keys in a stored event's JSON: a group never moves an event's field.


@dataclass(frozen=True, kw_only=True)
class _OfRollout(Event, group=True):
    """An event of one rollout."""

    __slots__ = ()
    rollout: str


@dataclass(frozen=True, kw_only=True)
class _OfCall(_OfRollout, group=True):
    """An event of one model call of a rollout."""

    __slots__ = ()
    call_id: str


@dataclass(frozen=True, kw_only=True)
class _OfPolicy(Event, group=True):
    """An event about the policy as it stands at a training step."""

    __slots__ = ()
    step: int
    policy_version: int


@dataclass(frozen=True, kw_only=True)
class _Round(Event, group=True):
    """The outcome of a round of rollouts sampled from one policy, with no training."""

    __slots__ = ()
    rollouts: tuple[str, ...]
    #: Mean and standard deviation of the rewards of the rollouts that finished with one.
    reward_mean: float
    reward_std: float
    #: Rollouts that failed or reported no reward (counted, not averaged in).
    failed: int
    #: The sampling parameters the round's calls were served with.
    sampling: JsonObject = field(default_factory=dict)


# --- run lifecycle -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplianceStarted(Event):
    """The process started (or restarted) on this store."""

    run_id: str
    model: str
    engine: str
    #: The policy version the engine and trainer were loaded at (0 on a fresh run).
    resumed_from_version: int
    #: The training step the run stands at after replay.
    resumed_from_step: int
    config: JsonObject = field(default_factory=dict)
    #: Training worker processes this start trains with (1 in logs written before it existed).
    trainer_ranks: int = 1
    #: The GPU placement this start runs with (``appliance.placement.plan.Plan.to_json``: the GPUs of
    #: each engine replica and of the trainer ranks, the memory figures, fits and why); empty in
    #: logs written before it existed, or when the model was not known before loading.
    placement: JsonObject = field(default_factory=dict)
    #: Where this start's agents run, in one line ("agents run sandboxed (bwrap; ...)", "agents
    #: run unsandboxed ..."); empty in logs written before it existed.
    agents: str = ""
    #: The command that started it: "up" (the run) or "eval" (an evaluation, which trains
    #: nothing: its start and stop are not the run's, ``RunState.last_start``/``last_stop``).
    command: str = "up"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplianceStopped(Event):
    """The process stopped cleanly (a crash leaves no such event)."""

    reason: str
    #: The run stopped because it could not go on (the circuit breaker gave up): ``up`` exits 1.
    failed: bool = False
    #: The command whose process stopped: "up" or "eval" (as its ``ApplianceStarted``).
    command: str = "up"


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChanged(Event):
    """The scheduler moved the machine between phases ("generate", "train", "idle")."""

    phase: str
    policy_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseOverran(Event):
    """A phase of the run took longer than its deadline (``phase``: a switch phase such as
    ``drain`` or ``train``, or ``stop``). While it lasts ``/healthz`` reports not ok with
    ``reason``. The drain's deadline is enforced: the calls still generating are preempted
    (``preempted``) and the step goes on; other phases are reported, not interrupted."""

    phase: str
    #: The training step the phase belongs to (0 when none).
    step: int = 0
    deadline_s: float
    reason: str
    #: Generations interrupted because the phase overran (drain only).
    preempted: int = 0


# --- rollouts ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutCreated(_OfRollout):
    """A rollout was admitted: one run of the harness on one task."""

    task_id: str
    #: Rollouts of one group share a task and are compared with each other (GRPO).
    group: str
    task: JsonObject
    #: The policy version being served when the rollout started.
    policy_version: int
    adapter: str
    #: "train" (its group is trained on) or "validation" (evaluation sampling, never trained on).
    purpose: str = "train"


@dataclass(frozen=True, slots=True, kw_only=True)
class LLMCallCompleted(_OfCall):
    """One model call made by a harness through the proxy, with the exact tokens involved."""

    #: Which API surface the harness used ("openai.chat", ...).
    surface: str
    prompt_ids: TokenIds
    response_ids: TokenIds
    #: Log-probability of each response token under the sampling distribution.
    response_logprobs: Floats
    #: The policy version that sampled the response (the oldest one, if it was preempted and
    #: continued under newer weights; ``response_versions`` has each token's).
    policy_version: int
    #: "stop", "length", or "cancelled" (the client went away; the tokens so far are kept).
    finish_reason: str
    #: The request body as the harness sent it (JSON), for audit and the dashboard.
    request: JsonObject
    #: The text the harness received.
    response_text: str
    #: Seconds: waiting for the engine, then generating.
    queue_s: float
    total_s: float
    user_agent: str = ""
    #: How many leading prompt tokens were spliced from earlier sampled turns (not re-rendered).
    spliced_tokens: int = 0
    #: Seconds from the request's arrival to the first sampled token.
    ttft_s: float = 0.0
    #: Assistant turns in the request that this rollout did not sample (the harness rewrote
    #: history, or they came from elsewhere): rendered from text, so the token prefix broke.
    unmatched_assistant_turns: int = 0
    #: The sampling parameters actually used (the client's request is in ``request``).
    sampling: JsonObject = field(default_factory=dict)
    #: Times a switch to training interrupted this call's generation (it then continued).
    preemptions: int = 0
    #: The policy version that sampled each response token (they differ after a preemption).
    response_versions: TokenIds = EMPTY
    #: Every assistant turn of the request not spliced exactly as it was returned, in order:
    #: ``{"message", "kind", "reason", "spliced", "sampled"}``, ``kind`` "arguments" (tool call
    #: arguments re-serialised), "cut" (a tool call cut by the length limit left out), "stop" (the
    #: returned text + its stop string), "text", "prefix" (of the sampled text), "extended" (the
    #: sampled text + text the harness added), or "unmatched" (its reason: "never sampled", "text
    #: differs at char N", "tool call 0 differs (arguments)", ...); see ``appliance.chat.turns``.
    assistant_turns: tuple[JsonObject, ...] = ()
    #: The stop string the response text was cut before ("" if none): ``response_ids`` hold what
    #: was sampled, up to the token that completed it; ``response_text`` what was returned.
    stop_sequence: str = ""

    def __post_init__(self) -> None:
        # The token fields as ``Tokens`` whatever sequence of ints was given (a tuple, a list).
        if type(self.prompt_ids) is not Tokens:
            object.__setattr__(self, "prompt_ids", Tokens(self.prompt_ids))
        if type(self.response_ids) is not Tokens:
            object.__setattr__(self, "response_ids", Tokens(self.response_ids))
        if type(self.response_versions) is not Tokens:
            object.__setattr__(self, "response_versions", Tokens(self.response_versions))


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseStored(_OfRollout):
    """A Responses call answered with ``store`` true (OpenAI's default): what ``GET
    /v1/responses/{id}``, its ``input_items`` and a later ``previous_response_id`` read, within
    the rollout that made it. Appended after the call's ``LLMCallCompleted`` and before the
    client hears the answer."""

    #: The response object exactly as the client received it (its ``id``, ``output`` items,
    #: ``previous_response_id``, ``usage``, ...).
    response: JsonObject
    #: The request's own input items, each with its ``id`` (the client's, or one assigned); the
    #: items before them are the input items and output of ``previous_response_id``'s response.
    input_items: tuple[JsonObject, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseDeleted(_OfRollout):
    """``DELETE /v1/responses/{id}``: the response is no longer retrievable nor chained on (a
    response already chained on it keeps its input items)."""

    response_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardReported(_OfRollout):
    """A reward for a whole rollout (the last one reported counts)."""

    reward: float
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRewardReported(_OfCall):
    """An intermediate reward for one call of a rollout (kept for analysis; the rollout's reward
    is still the last ``RewardReported``)."""

    reward: float
    source: str
    #: Optional label the reporter gave this signal ("tests_passed", "format", ...).
    name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LLMCallRefused(_OfRollout):
    """The proxy answered a model call of the rollout with an error instead of a completion (a
    prompt past the model's context, a malformed request, the engine unavailable, ...): nothing
    of it was sampled, so nothing of it can be trained on. Counted per rollout
    (``RolloutView.refused_calls``); a rollout whose calls were all refused, or more than
    ``max_refused_fraction`` of them, is failed with the refusal as its reason."""

    #: The route called, after the rollout's base URL ("/chat/completions", "/messages", ...).
    route: str
    #: The answer's HTTP status (200 when the error went out as an event of a stream already begun).
    status: int
    #: The error's code and type as the OpenAI shape names them ("context_length_exceeded",
    #: "invalid_request_error"); the code may be empty.
    code: str = ""
    error_type: str = ""
    #: The first line of the error's message.
    message: str = ""

    def reason(self) -> str:
        """The refusal in one line: ``code: message`` (the type when there is no code)."""
        return f"{self.code or self.error_type or self.status}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutFinished(_OfRollout):
    """The harness ended. ``status`` is "finished" or "failed"; a failure carries its reason."""

    status: str
    error: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutClaimed(_OfRollout):
    """An external runner claimed the rollout (``POST /admin/rollouts``); until then, a rollout
    of the ``external`` adapter is offered, not running."""


# --- training ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchPhaseCompleted(Event):
    """One phase of a switch between generating and training, with its duration.

    Phases, in order: ``drain`` (preempt and wait for generations), ``sleep`` (engine gives up
    memory), ``onload`` (trainer state to the accelerator), ``train`` (the step), ``offload``,
    ``wake_weights``, ``push`` (new weights into the engine), ``wake_kv_cache``.
    """

    step: int
    phase: str
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainStepFailed(Event):
    """The trainer raised during a step: nothing of it is durable, its groups stay ready and the
    step is tried again (the run stops after a few failures in a row)."""

    step: int
    groups: tuple[str, ...]
    error: str
    #: Failed attempts at this step in a row, this one included.
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainStepCompleted(Event):
    """A gradient step consumed these rollouts; each rollout is trained on at most once."""

    step: int
    rollouts: tuple[str, ...]
    samples: int
    #: Tokens of the trained sequences, prompt and sampled, as the trainer ran them. Not one of
    #: the token figures a person reads: ``metrics`` holds those (``tokens_sampled``,
    #: ``tokens_prompt``, ``tokens_trained``; docs/metrics.md defines them).
    tokens: int
    #: Groups whose rewards were all equal (zero advantage): counted, trained on as zero.
    zero_variance_groups: int
    metrics: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    #: Per rollout of ``rollouts``, in order: the tokens the policy sampled for it (every call).
    sampled: tuple[int, ...] = ()
    #: The rewards the step's mean reward averages (``store.projections.reward_mean``'s rule).
    rewards: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyVersionPublished(Event):
    """New weights are durable on disk and were (or will be, on restart) loaded by the engine."""

    policy_version: int
    step: int
    #: Path of the checkpoint holding these weights, relative to the run directory.
    checkpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationCompleted(_Round, _OfPolicy):
    """A round of validation rollouts (evaluation sampling, held-out tasks) ended."""


@dataclass(frozen=True, kw_only=True)
class _Evaluated(_OfPolicy, group=True):
    """What an evaluation ran: the tasks of a split, each some times (before its outcome)."""

    __slots__ = ()
    split: str
    repeat: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationCompleted(_Round, _Evaluated):
    """An evaluation (``lightning-appliance eval``) ended: every task of ``split`` run ``repeat``
    times on the policy at ``policy_version``, with no training."""

    #: The agent it played (``appliance.rollouts.evaluation.agent_label``); empty in logs
    #: written before it existed.
    agent: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSaved(_OfPolicy):
    """A full checkpoint (model, optimizer, trainer state) is durable on disk."""

    #: Relative to the run directory.
    path: str
    #: "periodic" (every N steps), "requested" (operator), or "shutdown".
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelExported(_OfPolicy):
    """The policy was exported as a Hugging Face model directory."""

    path: str


# --- admissions --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionsPaused(Event):
    """The circuit breaker tripped: ``failures`` training rollouts failed in a row, so no new
    rollout is admitted for ``backoff_s`` seconds (from ``ts``); ``cause`` is the last failure's
    reason (e.g. the agent's exit code and stderr tail). The back-off doubles with each trip
    that no finished rollout separates from the previous one. Steps, validation rounds and the
    calls of rollouts under way go on."""

    failures: int
    backoff_s: float
    cause: str
    #: Trips in a row (1 for the first since a rollout last finished).
    trips: int = 1


# --- operator control --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlRequested(Event):
    """An operator asked the run to change course (dashboard or admin API).

    ``action`` is "pause" (no new rollouts, no steps; calls in flight finish), "resume",
    "checkpoint" (save one now) or "stop" (finish the current step, save, exit).
    """

    action: str
    source: str = "admin"


# --- remote engine replicas ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRegistered(Event):
    """A vLLM server the appliance did not launch joined the engine fleet (``[engine] remote``
    or ``POST /admin/engines``) after its model was checked against the run's. A start
    re-attaches every replica registered and not removed since."""

    #: The replica's id in the fleet (``GET /admin/engines``, ``DELETE /admin/engines/{id}``).
    replica: str
    url: str
    #: The run's model it serves (the appliance's name for it).
    model: str
    #: The policy version it said it served (-1: unknown; it takes the run's before serving).
    policy_version: int = -1
    max_model_len: int = 0  #: the longest prompt + completion it serves, in tokens
    #: How it takes weights: "http" (pulls each published version) or "shm" ("": not said).
    weights: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLost(Event):
    """A remote replica left the fleet: it stopped answering (``reason`` says how), or an
    operator removed it (``removed``: a later start does not re-attach it)."""

    replica: str
    reason: str
    removed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCaughtUp(Event):
    """A remote replica took the run's policy version ``policy_version`` (after it joined, or
    after it fell behind): from here on it gets new rollouts."""

    replica: str
    policy_version: int
