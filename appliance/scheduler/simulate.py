"""A discrete-event simulator of the scheduler, driving the same ``decide`` on a simulated clock.

Owns the cost model (:class:`CostModel`), the rollout workloads (:class:`Workload`: ``SWE`` and
``UNIFORM``), the event loop (:class:`Simulator`), where each step's time goes
(:class:`Breakdown`, with the floor that the staleness bound puts under any schedule) and the
tables that ``scripts/simulate.py`` prints. Nothing here touches an engine, a store or the wall clock: it
predicts seconds per training step, GPU busy fraction and the staleness of trained tokens, for
``sync``, ``async`` and ``split`` scheduling on a machine of one or more GPUs (:class:`Layout`),
from a handful of measured figures. ``docs/scheduler.md`` documents the model and how to
calibrate it.

The machine, as simulated:

* GPUs: ``Layout.gpus`` in all. Collocated (sync, async) every GPU generates and trains in
  turn; split, ``Layout.split`` GPUs only generate and the others only train. The generating
  GPUs hold ``replicas`` engine replicas of equal size; a rollout stays on the replica it was
  admitted to (its KV cache is there), the least loaded one at admission.
* Generation: sequences that decode share their replica by processor sharing. With ``b``
  sequences decoding on a replica of one GPU, each samples ``peak_tokens_per_s / (b + b_half)``
  tokens/s (the aggregate ``peak * b / (b + b_half)`` saturates); a replica on ``t`` GPUs is
  ``t ** tp_exponent`` times as fast. Prompt tokens go through one FIFO prefill server per
  replica at ``prefill_tokens_per_s`` (times the same factor), which runs alongside decoding
  (chunked prefill, interference neglected). Tokens that a rollout's KV / prefix cache holds are
  not prefilled again.
* Tool time (the harness running commands) elapses off the GPU, in every phase.
* ``Train``, collocated: generation stops (sequences mid-call are preempted and resume later:
  partial rollouts), the switch to training takes ``switch_to_train_s``, the step ``(train_step_s
  + train_s_per_token * tokens) / gpus ** train_exponent``, the switch back
  ``switch_to_generate_s``; then the policy version is the step number. If
  ``kv_dropped_on_switch``, every running rollout's cache is lost and its next prefill recomputes
  its whole context.
* ``Train``, split: the step runs on the training GPUs while generation goes on; at its end
  generation pauses ``push_s`` for the weight push (sequences mid-call are preempted and continue
  under the new weights; ``kv_dropped_on_push``: the engines' caches are reset). No switch.
* Staleness: each sampled token keeps the version that sampled it; a step masks (as the training
  service does in async mode) tokens more than ``eta`` versions older than the weights it updates.

``decide`` is consulted after every event that changes what it observes: while the machine
generates (during a collocated step it answers nothing anyway, as in the live runner), and in
split mode also while a step runs (it admits beside it). A state from which no event can follow
and where ``decide`` answers nothing raises :class:`SimulationStalled`.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import insort
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from appliance.scheduler.decide import Mode, Observation, SchedulePolicy, StartGroups, Stop, Train, decide

#: Decode completions within this many tokens of the virtual clock finish together (float slack).
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class CostModel:
    """What the machine's work costs. Defaults: a 9B model in bf16 on one H200 (vLLM engine,
    collocated trainer); replace them with measured figures (``docs/scheduler.md``)."""

    #: Aggregate decode tokens/s the engine approaches as the batch grows (asymptote).
    peak_tokens_per_s: float = 8000.0
    #: Decoding sequences at which the aggregate reaches half its peak. One sequence alone gets
    #: ``peak / (1 + b_half)`` tokens/s (163 with the defaults).
    b_half: float = 48.0
    #: Aggregate prefill tokens/s (prompt tokens not in the KV / prefix cache).
    prefill_tokens_per_s: float = 30000.0
    #: Seconds of a training step independent of its size (optimizer, checkpoint, publishing).
    train_step_s: float = 30.0
    #: Seconds per trained token (prompt + sampled tokens of every rollout in the batch).
    train_s_per_token: float = 1.5e-4
    #: Seconds from the decision to train until the step starts (engine sleeps, trainer loads).
    switch_to_train_s: float = 10.0
    #: Seconds from the end of a step until the engine serves the new weights.
    switch_to_generate_s: float = 15.0
    #: A switch frees the KV cache: running rollouts recompute their context on their next call.
    kv_dropped_on_switch: bool = True
    #: Split mode: seconds generation pauses for each step's weight push (trainer GPUs to engine
    #: GPUs, and the engine loading them). Collocated, the push is in ``switch_to_generate_s``.
    push_s: float = 5.0
    #: A push resets the engines' prefix cache (vLLM's holds the old weights' keys and values):
    #: running rollouts recompute their context on their next call.
    kv_dropped_on_push: bool = True
    #: An engine replica on ``t`` GPUs (tensor parallel) is ``t ** tp_exponent`` times as fast as
    #: on one, decoding and prefilling (1: linear; all-reduces per layer make it less).
    tp_exponent: float = 0.8
    #: ``g`` GPUs take a training step ``g ** train_exponent`` times as fast as one (data
    #: parallel with sharded optimizer state; 1: linear).
    train_exponent: float = 0.9

    def decode_rate(self, decoding: int) -> float:
        """Tokens/s each of ``decoding`` concurrently decoding sequences samples (one GPU)."""
        # total(b) = peak * b / (b + b_half), shared equally: total(b) / b = peak / (b + b_half).
        return self.peak_tokens_per_s / (decoding + self.b_half)

    def replica_speed(self, gpus: int) -> float:
        """How many times as fast as one GPU's an engine replica on ``gpus`` GPUs is."""
        return math.pow(gpus, self.tp_exponent)

    def train_s(self, tokens: float, gpus: int = 1) -> float:
        """Seconds one step over ``tokens`` trained tokens takes on ``gpus`` GPUs (switches
        excluded)."""
        return (self.train_step_s + self.train_s_per_token * tokens) / math.pow(gpus, self.train_exponent)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: CostModel | None = None) -> CostModel:
        """``base`` (default: the defaults) with the fields named in ``values`` replaced, e.g. a
        JSON object of measured figures. Unknown names are an error."""
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"unknown cost model fields {unknown}; known: {sorted(names)}")
        converted: dict[str, Any] = {
            name: bool(value) if names[name].type == "bool" else float(value)
            for name, value in values.items()
        }
        return replace(base or cls(), **converted)


@dataclass(frozen=True, slots=True)
class Layout:
    """The simulated machine's GPUs and what each does."""

    #: GPUs in all (the cost model's figures are one GPU's).
    gpus: int = 1
    #: Split mode: the GPUs that generate; the others train. None: half of them, as
    #: ``appliance.placement`` plans it.
    split: int | None = None
    #: Engine replicas on the generating GPUs, each on an equal share of them (tensor parallel
    #: within a replica). None: one per generating GPU.
    replicas: int | None = None

    def pools(self, mode: Mode) -> tuple[int, int]:
        """GPUs that generate and GPUs that train; collocated, both are all of them."""
        if mode != "split":
            return self.gpus, self.gpus
        generating = self.gpus // 2 if self.split is None else self.split
        return generating, self.gpus - generating

    def replica_gpus(self, mode: Mode) -> tuple[int, ...]:
        """The GPUs of each engine replica, after checking that the layout works for ``mode``."""
        generating, training = self.pools(mode)
        if generating < 1 or training < 1:
            raise ValueError(
                f"split mode needs GPUs that generate and GPUs that train: {self.gpus} GPUs, "
                f"{generating} generating (split must be between 1 and gpus - 1)"
            )
        count = generating if self.replicas is None else self.replicas
        if count < 1 or generating % count:
            raise ValueError(f"{generating} generating GPUs do not make {count} equal engine replicas")
        return (generating // count,) * count

    def label(self, mode: Mode) -> str:
        """``8`` (collocated) or ``4+4`` (split: generating + training)."""
        generating, training = self.pools(mode)
        return f"{generating}+{training}" if mode == "split" else str(self.gpus)


@dataclass(frozen=True, slots=True)
class Call:
    """One model call of a rollout."""

    #: New prompt tokens before the call (the task for the first call, tool output after).
    prompt_tokens: int
    #: Tokens the call samples.
    gen_tokens: int
    #: Seconds the harness spends in tools after this call (0 after the last).
    tool_s: float


@dataclass(frozen=True, slots=True)
class Workload:
    """How rollouts are drawn. Counts are lognormal around a median (``sigma`` of the log; 0 makes
    them constant); tool time is log-uniform in ``[tool_min_s, tool_max_s]``."""

    name: str
    #: Model calls per rollout: median, log-spread, cap (the harness's step limit).
    calls_median: float
    calls_sigma: float
    max_calls: int
    #: Log-spread of a task's difficulty: one factor per group scales its rollouts' call counts.
    task_sigma: float
    #: Sampled tokens per call: median, log-spread, cap (max_tokens).
    gen_median: float
    gen_sigma: float
    max_gen_tokens: int
    #: Tokens of the first prompt (system prompt + task).
    first_prompt_tokens: int
    #: Tool output tokens added before each later call: median and log-spread.
    obs_median: float
    obs_sigma: float
    tool_min_s: float
    tool_max_s: float
    #: A rollout ends once its context would exceed this (the last call is cut to fit).
    max_context_tokens: int

    def draw_group(self, rng: random.Random, size: int) -> list[tuple[Call, ...]]:
        """The calls of each rollout of one group (one task)."""
        task = rng.lognormvariate(0.0, self.task_sigma)
        return [self._draw_rollout(rng, task) for _ in range(size)]

    def _draw_rollout(self, rng: random.Random, task: float) -> tuple[Call, ...]:
        def lognormal(median: float, sigma: float, cap: int) -> int:
            return max(1, min(cap, round(median * rng.lognormvariate(0.0, sigma))))

        n_calls = lognormal(self.calls_median * task, self.calls_sigma, self.max_calls)
        calls: list[Call] = []
        context = 0
        for i in range(n_calls):
            prompt = self.first_prompt_tokens if i == 0 else lognormal(self.obs_median, self.obs_sigma, 10**9)
            gen = lognormal(self.gen_median, self.gen_sigma, self.max_gen_tokens)
            tool_s = math.exp(rng.uniform(math.log(self.tool_min_s), math.log(self.tool_max_s)))
            room = self.max_context_tokens - context - prompt
            if room < 1 and calls:
                break
            gen = max(1, min(gen, room))
            context += prompt + gen
            calls.append(Call(prompt, gen, tool_s))
            if gen >= room:
                break
        calls[-1] = replace(calls[-1], tool_s=0.0)
        return tuple(calls)


#: SWE-agent-like: many short rollouts, a few very long ones (hard tasks, long calls, long tool
#: output), 1-20 s of tool time between calls, a 64k context. Per rollout (seed 0): calls p50 18,
#: p90 53, max ~100; context p50 17k, p90 47k tokens; tool time p50 ~110 s, max ~620 s.
SWE = Workload(
    name="swe",
    calls_median=18,
    calls_sigma=0.7,
    max_calls=100,
    task_sigma=0.5,
    gen_median=150,
    gen_sigma=1.0,
    max_gen_tokens=4096,
    first_prompt_tokens=3000,
    obs_median=350,
    obs_sigma=1.0,
    tool_min_s=1.0,
    tool_max_s=20.0,
    max_context_tokens=65536,
)

#: Every rollout the same: 12 calls of 200 tokens, 500 tokens of tool output, 5 s of tool time.
UNIFORM = Workload(
    name="uniform",
    calls_median=12,
    calls_sigma=0.0,
    max_calls=12,
    task_sigma=0.0,
    gen_median=200,
    gen_sigma=0.0,
    max_gen_tokens=200,
    first_prompt_tokens=3000,
    obs_median=500,
    obs_sigma=0.0,
    tool_min_s=5.0,
    tool_max_s=5.0,
    max_context_tokens=32768,
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (SWE, UNIFORM)}


class SimulationStalled(RuntimeError):
    """Nothing can happen any more and ``decide`` answers nothing: a scheduling deadlock."""

    def __init__(self, now: float, observation: Observation) -> None:
        super().__init__(f"stalled at t={now:.1f}s: decide answers nothing to {observation}")
        self.observation = observation


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated run, measured over the steps after the warm-up."""

    workload: str
    mode: str
    eta: int
    steps: int
    #: End-to-end simulated seconds per training step.
    seconds_per_step: float
    #: Fraction of the GPU time (all GPUs) spent decoding, prefilling or training (switches and
    #: pushes excluded). A replica counts as busy while it decodes even one sequence.
    busy_fraction: float
    #: Fraction of the time generation is stopped by switches (both directions) or, in split
    #: mode, by weight pushes.
    switch_fraction: float
    #: Fraction of the time spent in training steps: of the whole machine's time collocated, of
    #: the training GPUs' in split mode.
    train_fraction: float
    #: Token-weighted mean of (step - 1 - version the token was sampled under) over trained
    #: sampled tokens; the step trains the weights of version ``step - 1``.
    mean_staleness: float
    #: The largest staleness of a trained token (at most ``eta``: the trainer masks the rest).
    max_staleness: int
    #: The largest staleness of a sampled token in a trained group, before that mask.
    max_sampled_staleness: int
    #: Fraction of sampled tokens in trained groups masked out as more than ``eta`` stale (async
    #: mode; the training service's ``bound_staleness``): a long rollout's oldest tokens, when
    #: later groups overtook it.
    masked_fraction: float
    #: Trained (unmasked) sampled tokens per second.
    trained_tokens_per_s: float
    #: Mean number of sequences decoding at once, while any decodes.
    mean_decode_batch: float
    #: Cached context tokens a switch or a push dropped (recomputed by prefill later), per step.
    dropped_kv_tokens_per_step: float
    stop_reason: str
    #: The layout: GPUs in all, generating, training (collocated: all three the same), and the
    #: engine replicas on the generating ones.
    gpus: int = 1
    gen_gpus: int = 1
    train_gpus: int = 1
    replicas: int = 1
    #: Fraction of the generating GPUs' time spent decoding or prefilling.
    gen_busy_fraction: float = 0.0
    #: Where each step's time goes, in seconds per step (:class:`Breakdown`).
    breakdown: Breakdown | None = None


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Seconds per step, over the measured window. ``idle`` and ``reprefill`` are the generating
    GPUs' (GPU-seconds over their count); the rest are wall-clock seconds. They overlap:
    ``idle`` and ``order_wait`` are generation time, ``reprefill`` part of the GPUs' busy time."""

    #: The engine serves (collocated: between switches; split: but for the pushes).
    generate: float
    #: Generating GPUs serving with nothing to decode or prefill (every rollout in a tool or
    #: waiting on none), while the engine serves.
    idle: float
    #: Prefill that recomputes context a switch or a push dropped from the KV cache.
    reprefill: float
    #: Serving while ``batch_groups`` groups are ready but an older group still runs (training
    #: in admission order waits for it).
    order_wait: float
    #: Switches (collocated) or pushes (split): generation stands still.
    pause: float
    #: The step itself (collocated: the whole machine; split: the training GPUs).
    train: float
    #: The step's critical rollout (the last of its groups to end): admission to end, of which
    #: in tools, and mid-call while the engine did not serve it (held by a switch, a step or a
    #: push); the rest it spent prefilling, decoding or queued for them. ``critical_served``:
    #: of its life, the seconds the engine served (not switching, training or pushing).
    critical: float
    critical_tool: float
    critical_held: float
    critical_served: float

    def floor(self, mode: str, eta: int) -> float:
        """The fewest seconds per step that these critical rollouts allow, within the staleness
        bound: a group admitted under version ``v`` is trained by step ``v + eta + 1``, so its
        life fits in ``eta + 1`` generation phases (and the ``eta`` steps between them).

        Collocated, the engine serves only between steps, so ``eta + 1`` generation phases
        must hold the critical rollout's serving time: ``pause + train + critical_served /
        (eta + 1)`` (sync: ``eta = 0``). Split, generation goes on beside the step, but a
        group admitted once a step's weights serve waits ``train + pause`` of the ``eta + 1``
        periods: ``(critical + train + pause) / (eta + 1)``, and never less than a step and
        its push. A bound on what reordering the same work could give, not a prediction."""
        eta = 0 if mode == "sync" else eta
        if mode == "split":
            return max(self.train + self.pause, (self.critical + self.train + self.pause) / (eta + 1))
        return self.pause + self.train + self.critical_served / (eta + 1)


@dataclass(slots=True, eq=False)
class _Group:
    index: int
    admitted_version: int  # the policy version served when it was admitted
    rollouts: list[_Rollout] = field(default_factory=list)
    running: int = 0
    trained_step: int | None = None


@dataclass(slots=True, eq=False)
class _Replica:
    """One engine replica: its decode clock, its decoding sequences and its prefill server."""

    gpus: int
    speed: float  # times one GPU's engine
    vclock: float = 0.0  # tokens each decoding sequence has sampled since t=0 (virtual clock)
    decoding: list[tuple[float, int, _Rollout]] = field(default_factory=list)  # (vclock at end, seq, r)
    prefill_queue: deque[_Rollout] = field(default_factory=deque)
    prefill_job: tuple[int, _Rollout, float, float] | None = None  # (event seq, rollout, t0, tokens)
    assigned: int = 0  # running rollouts on it


@dataclass(slots=True, eq=False)
class _Rollout:
    group: _Group
    calls: tuple[Call, ...]
    replica: _Replica
    call: int = 0  # index of the current (or next) call
    context: float = 0.0  # tokens of its context so far (prompts + sampled)
    cached: float = 0.0  # of those, how many the engine's cache holds
    to_decode: float = 0.0  # tokens still to sample in the current call
    seg_start: float = 0.0  # virtual decode clock when its current decode segment began
    sampled: dict[int, float] = field(default_factory=dict)  # sampled tokens by policy version
    admitted_at: float = 0.0
    ended_at: float = 0.0
    serving_at_admission: float = 0.0  # the serving clock (``_Meter.serving``) when admitted
    served: float = 0.0  # seconds alive while the engine served, from admission to end
    recompute: float = 0.0  # context tokens a switch or a push dropped, not prefilled again yet
    held_since: float | None = None  # mid-call while the engine does not serve it, since
    held: float = 0.0  # seconds mid-call while the engine did not serve it (switch, step, push)


@dataclass(slots=True)
class _Meter:
    """Cumulative counters; a snapshot at each step end delimits the measured window."""

    now: float = 0.0
    gen_busy: float = 0.0  # GPU-seconds of replicas decoding or prefilling
    switch: float = 0.0  # seconds generation stood still for a switch or a push
    train: float = 0.0  # seconds a step ran
    serving: float = 0.0  # seconds the engine served (generate phase): the serving clock
    gen_idle: float = 0.0  # GPU-seconds the generating GPUs served with nothing to decode or prefill
    reprefill: float = 0.0  # GPU-seconds of prefill recomputing context a switch or a push dropped
    order_wait: float = 0.0  # seconds serving with a batch ready but an older group still running
    # The critical rollout of each step (the last of its groups to end), summed over steps:
    # admission to end, of which in tools, and mid-call while the engine did not serve it.
    critical: float = 0.0
    critical_tool: float = 0.0
    critical_held: float = 0.0
    critical_served: float = 0.0
    decoding: float = 0.0  # replica-seconds with at least one sequence decoding
    decode_seq_s: float = 0.0  # integral of the number of decoding sequences over time
    dropped_kv: float = 0.0
    stale_tokens: float = 0.0  # sum of staleness * tokens, over trained tokens
    tokens: float = 0.0  # trained sampled tokens
    masked: float = 0.0  # sampled tokens masked out as too stale
    max_staleness: int = 0  # of trained tokens, this step
    max_sampled_staleness: int = 0  # of sampled tokens in trained groups, this step


class Simulator:
    """One run of ``policy`` over ``workload`` under ``cost`` on ``layout``. Group ``g`` always
    draws the same rollouts for a seed, so runs of different modes see the same tasks in the
    same order."""

    def __init__(
        self,
        policy: SchedulePolicy,
        cost: CostModel,
        workload: Workload,
        seed: int = 0,
        layout: Layout | None = None,
    ) -> None:
        self.policy, self.cost, self.workload, self.seed = policy, cost, workload, seed
        self.layout = layout or Layout()
        self.split = policy.mode == "split"
        self.gen_gpus, self.train_gpus = self.layout.pools(policy.mode)
        self.replicas = [
            _Replica(gpus, cost.replica_speed(gpus)) for gpus in self.layout.replica_gpus(policy.mode)
        ]
        self.now = 0.0
        # What the generating GPUs do: generate | to_train | train | to_generate (collocated
        # switches) or generate | push (split).
        self.phase = "generate"
        self.stepping = False  # split: a step runs, from Train until its push has ended
        self.trainer_busy = False  # split: the training GPUs run a step
        self.generate_since = 0.0
        self.step = self.version = 0
        self.groups: list[_Group] = []
        self.running_groups = 0
        self.ready: list[int] = []  # indices of ready, untrained groups, in admission order
        self.ready_names: tuple[str, ...] = ()  # the same as decide sees them
        self.dirty = True  # the observation changed since decide last answered
        self.running: dict[int, _Rollout] = {}  # by id(), in admission order
        self.training: list[_Group] = []
        self.order_wait = False  # a batch is ready but an older group still runs (decide's view)
        self.stop_reason: str | None = None
        self.events: list[tuple[float, int, str, _Rollout | None]] = []
        self.seq = 0
        self.meter = _Meter()
        self.snapshots: list[_Meter] = [replace(self.meter)]  # one at t=0, then one per step

    # --- observation and decisions ---------------------------------------------------------------

    def observe(self) -> Observation:
        serving = self.phase == "generate" and not self.stepping
        # Ready groups ahead of the oldest untrained group still running, in admission order.
        in_order = 0
        for group in self.groups:
            if group.trained_step is not None:
                continue
            if group.running:
                break
            in_order += 1
        return Observation(
            running_groups=self.running_groups,
            ready_groups=self.ready_names,
            step=self.step,
            policy_version=self.version,
            admitted_groups=len(self.groups),
            running_rollouts=len(self.running),
            phase="generate" if serving else "train",
            generating_for_s=self.now - self.generate_since if serving else 0.0,
            ready_in_order=in_order,
        )

    def _consult(self) -> None:
        # Only an admission, a rollout's end, a phase change or the min_generate_s wake-up
        # change what decide sees (tool and prefill events do not), so only these consult it.
        # Collocated, a step leaves it nothing to decide; split, it admits beside the step.
        for _ in range(10_000):
            if not self.dirty or self.stop_reason is not None:
                return
            if self.phase != "generate" and not self.split:
                return
            self.dirty = False
            observation = self.observe()
            batch = self.policy.batch_groups
            self.order_wait = (
                len(observation.ready_groups) >= batch and (observation.ready_in_order or 0) < batch
            )
            actions = decide(self.policy, observation)
            if not actions:
                return
            for action in actions:
                match action:
                    case StartGroups(count=count):
                        for _ in range(count):
                            self._admit_group()
                        self.dirty = True
                    case Train(groups=names):
                        self._start_train([self.groups[int(name[1:])] for name in names])
                    case Stop(reason=reason):
                        self.stop_reason = reason
                    case _:
                        raise RuntimeError(f"the simulated engine never fails; got {action}")
        raise RuntimeError(f"decide keeps acting without the state settling: {self.observe()}")

    # --- the event loop --------------------------------------------------------------------------

    def run(self) -> None:
        """Until ``decide`` says stop."""
        self._enter_generate()
        while True:
            self._consult()
            if self.stop_reason is not None:
                return
            t_decode, first = math.inf, None
            if self.phase == "generate":
                for replica in self.replicas:
                    if replica.decoding:
                        rate = self.cost.decode_rate(len(replica.decoding)) * replica.speed
                        t = self.now + max(0.0, replica.decoding[0][0] - replica.vclock) / rate
                        if t < t_decode:
                            t_decode, first = t, replica
            t_event = self.events[0][0] if self.events else math.inf
            if first is None and math.isinf(t_event):
                raise SimulationStalled(self.now, self.observe())
            if first is not None and t_decode <= t_event:
                self._advance(t_decode)
                self._finish_decodes(first)
            else:
                t, seq, kind, rollout = heapq.heappop(self.events)
                self._advance(t)
                self._handle(kind, seq, rollout)

    def _schedule(self, t: float, kind: str, rollout: _Rollout | None = None) -> int:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, rollout))
        return self.seq

    def _advance(self, t: float) -> None:
        dt, m = t - self.now, self.meter
        if self.phase == "generate":
            m.serving += dt
            if self.order_wait:
                m.order_wait += dt
            for replica in self.replicas:
                b = len(replica.decoding)
                if b or replica.prefill_job is not None:
                    m.gen_busy += replica.gpus * dt
                else:
                    m.gen_idle += replica.gpus * dt
                if b:
                    m.decoding += dt
                    m.decode_seq_s += b * dt
                    replica.vclock += self.cost.decode_rate(b) * replica.speed * dt
        elif self.phase == "train":
            m.train += dt
        else:
            m.switch += dt
        if self.trainer_busy:
            m.train += dt
        self.now = m.now = t

    def _handle(self, kind: str, seq: int, rollout: _Rollout | None) -> None:
        if kind == "tool" and rollout is not None:
            rollout.call += 1
            self._begin_call(rollout)
        elif kind == "prefill" and rollout is not None:
            replica = rollout.replica
            if replica.prefill_job is None or replica.prefill_job[0] != seq:
                return  # a job that a switch or a push preempted
            replica.prefill_job = None
            rollout.cached = rollout.context
            self._start_decode(rollout)
            self._serve_prefill(replica)
        elif kind == "to_train":
            self.phase = "train"
            tokens = sum(r.context for g in self.training for r in g.rollouts)
            self._schedule(self.now + self.cost.train_s(tokens, self.train_gpus), "trained")
        elif kind == "trained":
            self._finish_train()
        elif kind in ("to_generate", "pushed"):
            self.stepping = False
            self.version = self.step
            self._enter_generate()
        elif kind == "wake":
            self.dirty = True  # min_generate_s has passed: decide may now train

    # --- rollouts --------------------------------------------------------------------------------

    def _admit_group(self) -> None:
        group = _Group(len(self.groups), self.version)
        rng = random.Random(f"{self.seed}/{group.index}")
        for calls in self.workload.draw_group(rng, self.policy.group_size):
            replica = min(self.replicas, key=lambda r: r.assigned)  # the least loaded, first on ties
            replica.assigned += 1
            rollout = _Rollout(
                group, calls, replica, admitted_at=self.now, serving_at_admission=self.meter.serving
            )
            group.rollouts.append(rollout)
            self.running[id(rollout)] = rollout
            self._begin_call(rollout)
        group.running = len(group.rollouts)
        self.running_groups += 1
        self.groups.append(group)

    def _begin_call(self, rollout: _Rollout) -> None:
        call = rollout.calls[rollout.call]
        rollout.context += call.prompt_tokens
        rollout.to_decode = call.gen_tokens
        if self.phase != "generate":
            rollout.held_since = self.now  # it waits for the engine to serve again
        rollout.replica.prefill_queue.append(rollout)
        self._serve_prefill(rollout.replica)

    def _serve_prefill(self, replica: _Replica) -> None:
        """Start the replica's next prefill job if it serves and its server is free."""
        while self.phase == "generate" and replica.prefill_job is None and replica.prefill_queue:
            rollout = replica.prefill_queue.popleft()
            tokens = rollout.context - rollout.cached
            if tokens <= _EPS:
                self._start_decode(rollout)
                continue
            rate = self.cost.prefill_tokens_per_s * replica.speed
            recomputed = min(rollout.recompute, tokens)
            rollout.recompute -= recomputed
            self.meter.reprefill += recomputed / rate * replica.gpus
            job = self._schedule(self.now + tokens / rate, "prefill", rollout)
            replica.prefill_job = (job, rollout, self.now, tokens)

    def _start_decode(self, rollout: _Rollout) -> None:
        replica = rollout.replica
        rollout.seg_start = replica.vclock
        self.seq += 1
        heapq.heappush(replica.decoding, (replica.vclock + rollout.to_decode, self.seq, rollout))

    def _credit(self, rollout: _Rollout, tokens: float) -> None:
        """``tokens`` sampled under the version now served join the rollout's context."""
        rollout.sampled[self.version] = rollout.sampled.get(self.version, 0.0) + tokens
        rollout.context += tokens

    def _finish_decodes(self, replica: _Replica) -> None:
        # Every sequence of a replica gains the same tokens per unit of its virtual clock, so the
        # heap's head is the next to finish; land the clock on it exactly to shed the float error
        # of dt * rate.
        replica.vclock = max(replica.vclock, replica.decoding[0][0])
        while replica.decoding and replica.decoding[0][0] <= replica.vclock + _EPS:
            finish, _, rollout = heapq.heappop(replica.decoding)
            self._credit(rollout, finish - rollout.seg_start)
            rollout.cached, rollout.to_decode = rollout.context, 0.0
            call = rollout.calls[rollout.call]
            if rollout.call + 1 < len(rollout.calls):
                self._schedule(self.now + call.tool_s, "tool", rollout)
            else:
                del self.running[id(rollout)]
                rollout.ended_at = self.now
                rollout.served = self.meter.serving - rollout.serving_at_admission
                replica.assigned -= 1
                rollout.group.running -= 1
                if rollout.group.running == 0:
                    self.running_groups -= 1
                    insort(self.ready, rollout.group.index)
                    self.ready_names = tuple(f"g{i}" for i in self.ready)
                self.dirty = True

    # --- switching, training and pushing ---------------------------------------------------------

    def _start_train(self, groups: Sequence[_Group]) -> None:
        """Collocated: preempt generation (partial rollouts) and start the switch to training.
        Split: start the step on the training GPUs; generation goes on."""
        chosen = {g.index for g in groups}
        if not chosen <= set(self.ready):
            raise RuntimeError(f"decide trains groups that are not ready: {sorted(chosen)}")
        self.ready = [i for i in self.ready if i not in chosen]
        self.ready_names = tuple(f"g{i}" for i in self.ready)
        self.training = list(groups)
        if self.split:
            self.stepping = self.trainer_busy = True
            self.dirty = True  # decide sees the step, and admits beside it
            tokens = sum(r.context for g in self.training for r in g.rollouts)
            self._schedule(self.now + self.cost.train_s(tokens, self.train_gpus), "trained")
            return
        self._stop_generating(self.cost.kv_dropped_on_switch)
        self.phase = "to_train"
        self._schedule(self.now + self.cost.switch_to_train_s, "to_train")

    def _stop_generating(self, drop_kv: bool) -> None:
        """Preempt every replica's decoding and prefill: what each sequence sampled so far stays,
        under the version served now; the rest waits for generation to go on."""
        for replica in self.replicas:
            preempted: list[_Rollout] = []
            for _, _, rollout in sorted(replica.decoding, key=lambda entry: entry[1]):
                done = replica.vclock - rollout.seg_start
                self._credit(rollout, done)
                rollout.cached += done
                rollout.to_decode -= done
                preempted.append(rollout)
            replica.decoding = []
            if replica.prefill_job is not None:
                _, rollout, t0, tokens = replica.prefill_job
                rate = self.cost.prefill_tokens_per_s * replica.speed
                rollout.cached += min(tokens, (self.now - t0) * rate)
                preempted.insert(0, rollout)
                replica.prefill_job = None
            replica.prefill_queue.extendleft(reversed(preempted))
            for rollout in replica.prefill_queue:
                if rollout.held_since is None:
                    rollout.held_since = self.now  # mid-call: it waits for the engine
        if drop_kv:
            for rollout in self.running.values():
                self.meter.dropped_kv += rollout.cached
                rollout.recompute += rollout.cached
                rollout.cached = 0.0

    def _finish_train(self) -> None:
        if self.split:
            # The push: generation pauses (what it sampled so far is the old version's).
            self.trainer_busy = False
            self._stop_generating(self.cost.kv_dropped_on_push)
        self.step += 1
        m = self.meter
        # As the training service does: in async and split modes, tokens more than eta versions
        # older than the weights being updated (version step - 1) are masked out of the loss.
        bound = None if self.policy.mode == "sync" else self.policy.eta
        critical = max((r for g in self.training for r in g.rollouts), key=lambda r: r.ended_at)
        m.critical += critical.ended_at - critical.admitted_at
        m.critical_tool += sum(call.tool_s for call in critical.calls)
        m.critical_held += critical.held
        m.critical_served += critical.served
        for group in self.training:
            group.trained_step = self.step
            for rollout in group.rollouts:
                for version, tokens in rollout.sampled.items():
                    staleness = self.step - 1 - version
                    m.max_sampled_staleness = max(m.max_sampled_staleness, staleness)
                    if bound is not None and staleness > bound:
                        m.masked += tokens
                        continue
                    m.stale_tokens += staleness * tokens
                    m.tokens += tokens
                    m.max_staleness = max(m.max_staleness, staleness)
        self.training = []
        self.snapshots.append(replace(m))
        # Maxima are per step: the window's is taken over its snapshots.
        m.max_staleness = m.max_sampled_staleness = 0
        if self.split:
            # The new version serves once pushed: until then decide sees (and admits against)
            # the old one, as the live runner's observation does.
            self.phase = "push"
            self._schedule(self.now + self.cost.push_s, "pushed")
        else:
            self.version = self.step
            self.phase = "to_generate"
            self._schedule(self.now + self.cost.switch_to_generate_s, "to_generate")

    def _enter_generate(self) -> None:
        self.phase = "generate"
        self.dirty = True
        self.generate_since = self.now
        if self.policy.min_generate_s > 0 and not self.split:
            # The first float t with t - generate_since >= min_generate_s, so decide sees it.
            t = self.now + self.policy.min_generate_s
            while t - self.generate_since < self.policy.min_generate_s:
                t = math.nextafter(t, math.inf)
            self._schedule(t, "wake")
        for rollout in self.running.values():
            if rollout.held_since is not None:
                rollout.held += self.now - rollout.held_since
                rollout.held_since = None
        for replica in self.replicas:
            # Preempted sequences whose cache survived resume at once; the rest queue.
            for rollout in [r for r in replica.prefill_queue if r.context - r.cached <= _EPS]:
                replica.prefill_queue.remove(rollout)
                self._start_decode(rollout)
            self._serve_prefill(replica)

    def result(self, warmup: int) -> SimResult:
        """Measured from the end of step ``warmup`` to the end of the last step."""
        if len(self.snapshots) <= warmup + 1:
            raise ValueError(f"only {len(self.snapshots) - 1} steps ran; need more than warmup={warmup}")
        a, b = self.snapshots[warmup], self.snapshots[-1]
        window = self.snapshots[warmup + 1 :]
        span, steps = b.now - a.now, len(window)
        tokens, masked = b.tokens - a.tokens, b.masked - a.masked
        decoding = b.decoding - a.decoding
        gen_busy, train = b.gen_busy - a.gen_busy, b.train - a.train
        return SimResult(
            workload=self.workload.name,
            mode=self.policy.mode,
            eta=0 if self.policy.mode == "sync" else self.policy.eta,
            steps=steps,
            seconds_per_step=span / steps,
            busy_fraction=(gen_busy + self.train_gpus * train) / (self.layout.gpus * span),
            switch_fraction=(b.switch - a.switch) / span,
            train_fraction=train / span,
            mean_staleness=(b.stale_tokens - a.stale_tokens) / tokens if tokens else 0.0,
            max_staleness=max(s.max_staleness for s in window),
            max_sampled_staleness=max(s.max_sampled_staleness for s in window),
            masked_fraction=masked / (tokens + masked) if tokens + masked else 0.0,
            trained_tokens_per_s=tokens / span,
            mean_decode_batch=(b.decode_seq_s - a.decode_seq_s) / decoding if decoding else 0.0,
            dropped_kv_tokens_per_step=(b.dropped_kv - a.dropped_kv) / steps,
            stop_reason=self.stop_reason or "",
            gpus=self.layout.gpus,
            gen_gpus=self.gen_gpus,
            train_gpus=self.train_gpus,
            replicas=len(self.replicas),
            gen_busy_fraction=gen_busy / (self.gen_gpus * span),
            breakdown=Breakdown(
                generate=(b.serving - a.serving) / steps,
                idle=(b.gen_idle - a.gen_idle) / self.gen_gpus / steps,
                reprefill=(b.reprefill - a.reprefill) / self.gen_gpus / steps,
                order_wait=(b.order_wait - a.order_wait) / steps,
                pause=(b.switch - a.switch) / steps,
                train=train / steps,
                critical=(b.critical - a.critical) / steps,
                critical_tool=(b.critical_tool - a.critical_tool) / steps,
                critical_held=(b.critical_held - a.critical_held) / steps,
                critical_served=(b.critical_served - a.critical_served) / steps,
            ),
        )


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


def speedup(results: Sequence[SimResult], result: SimResult) -> tuple[float, float]:
    """Over sync on the same workload: steps per second, and trained tokens per second (which
    counts the tokens async masks as too stale against it)."""
    sync = next(r for r in results if r.workload == result.workload and r.mode == "sync")
    return (
        sync.seconds_per_step / result.seconds_per_step,
        result.trained_tokens_per_s / sync.trained_tokens_per_s,
    )


def format_table(results: Sequence[SimResult]) -> str:
    """A fixed-width table of ``results`` with the speedup of each over sync."""
    header = (
        f"{'workload':<9} {'mode':<6} {'eta':>3} {'s/step':>8} {'busy':>6} {'switch':>6} {'train':>6} "
        f"{'stale':>5} {'max':>3} {'masked':>6} {'batch':>5} {'KV drop/step':>12} {'speedup':>7} "
        f"{'tokens':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        eta = "-" if r.mode == "sync" else str(r.eta)
        steps, tokens = speedup(results, r)
        lines.append(
            f"{r.workload:<9} {r.mode:<6} {eta:>3} {r.seconds_per_step:>8.1f} {r.busy_fraction:>6.1%} "
            f"{r.switch_fraction:>6.1%} {r.train_fraction:>6.1%} {r.mean_staleness:>5.2f} "
            f"{r.max_sampled_staleness:>3d} {r.masked_fraction:>6.1%} {r.mean_decode_batch:>5.1f} "
            f"{r.dropped_kv_tokens_per_step:>12,.0f} {steps:>6.2f}x {tokens:>5.2f}x"
        )
    return "\n".join(lines)


def format_placements(results: Sequence[SimResult]) -> str:
    """A fixed-width table of collocated and split runs side by side: the GPUs (``8``
    collocated, ``4+4`` split: generating + training), the engine replicas (count x GPUs each),
    the busy share of each pool, and the speedup over collocated sync."""
    header = (
        f"{'workload':<9} {'gpus':>5} {'engines':>7} {'mode':<6} {'eta':>3} {'s/step':>8} {'busy':>6} "
        f"{'gen':>6} {'train':>6} {'pause':>6} {'stale':>5} {'batch':>5} {'KV drop/step':>12} "
        f"{'speedup':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        gpus = f"{r.gen_gpus}+{r.train_gpus}" if r.mode == "split" else str(r.gpus)
        engines = f"{r.replicas}x{r.gen_gpus // r.replicas}"
        eta = "-" if r.mode == "sync" else str(r.eta)
        steps, _ = speedup(results, r)
        lines.append(
            f"{r.workload:<9} {gpus:>5} {engines:>7} {r.mode:<6} {eta:>3} {r.seconds_per_step:>8.1f} "
            f"{r.busy_fraction:>6.1%} {r.gen_busy_fraction:>6.1%} {r.train_fraction:>6.1%} "
            f"{r.switch_fraction:>6.1%} {r.mean_staleness:>5.2f} {r.mean_decode_batch:>5.1f} "
            f"{r.dropped_kv_tokens_per_step:>12,.0f} {steps:>6.2f}x"
        )
    return "\n".join(lines)


def format_breakdown(results: Sequence[SimResult]) -> str:
    """Where each run's time goes, seconds per step (:class:`Breakdown`), and the floor that its
    critical rollouts put under any schedule within the same staleness bound."""
    header = (
        f"{'workload':<9} {'gpus':>5} {'mode':<6} {'eta':>3} {'s/step':>7} {'floor':>7} {'train':>6} "
        f"{'pause':>6} {'idle':>6} {'tail':>6} {'reprefill':>9} {'critical':>8} {'tool':>6} {'held':>6} "
        f"{'served':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        b = r.breakdown
        if b is None:
            continue
        gpus = f"{r.gen_gpus}+{r.train_gpus}" if r.mode == "split" else str(r.gpus)
        eta = "-" if r.mode == "sync" else str(r.eta)
        lines.append(
            f"{r.workload:<9} {gpus:>5} {r.mode:<6} {eta:>3} {r.seconds_per_step:>7.1f} "
            f"{b.floor(r.mode, r.eta):>7.1f} {b.train:>6.1f} {b.pause:>6.1f} {b.idle:>6.1f} "
            f"{b.order_wait:>6.1f} {b.reprefill:>9.1f} {b.critical:>8.1f} {b.critical_tool:>6.1f} "
            f"{b.critical_held:>6.1f} {b.critical_served:>6.1f}"
        )
    return "\n".join(lines)
