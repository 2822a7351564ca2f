"""The simulator's event loop: the same ``decide`` as the live runner, on a simulated clock.

Owns :class:`Simulator`: the rollouts, engine replicas and phases of one run, the heap of
timed events (tool calls ending, prefills ending, switches, steps, pushes) and the virtual
decode clock of each replica, advanced by the cost model (``costs``) and metered into
``results.Meter``. Nothing here touches an engine, a store or the wall clock.

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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from appliance.scheduler.decide import Observation, SchedulePolicy, StartGroups, Stop, Train, decide
from appliance.scheduler.simulate.costs import CostModel, Layout
from appliance.scheduler.simulate.results import Meter, SimResult, measure
from appliance.scheduler.simulate.workloads import Call, Workload


class RolloutSource(Protocol):
    """Where a simulation's rollouts come from: a :class:`Workload` draws them, recorded runs
    (``calibrate.RecordedRollouts``) replay them. A rollout is its calls; the last call's
    ``tool_s`` is the harness's work after it (scoring, reporting) before the rollout ends, and a
    call that samples no token is the harness's work alone (starting up, before its first call):
    ``tool_s`` off the GPU, nothing prefilled or decoded."""

    @property
    def name(self) -> str: ...

    def draw_group(self, rng: random.Random, size: int) -> list[tuple[Call, ...]]:
        """The calls of each rollout of the next group admitted."""
        ...


#: Decode completions within this many tokens of the virtual clock finish together (float slack).
_EPS = 1e-9


class SimulationStalled(RuntimeError):
    """Nothing can happen any more and ``decide`` answers nothing: a scheduling deadlock."""

    def __init__(self, now: float, observation: Observation) -> None:
        super().__init__(f"stalled at t={now:.1f}s: decide answers nothing to {observation}")
        self.observation = observation


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
    serving_at_admission: float = 0.0  # the serving clock (``Meter.serving``) when admitted
    served: float = 0.0  # seconds alive while the engine served, from admission to end
    recompute: float = 0.0  # context tokens a switch or a push dropped, not prefilled again yet
    held_since: float | None = None  # mid-call while the engine does not serve it, since
    held: float = 0.0  # seconds mid-call while the engine did not serve it (switch, step, push)


class Simulator:
    """One run of ``policy`` over ``workload`` under ``cost`` on ``layout``. Group ``g`` always
    draws the same rollouts for a seed, so runs of different modes see the same tasks in the
    same order."""

    def __init__(
        self,
        policy: SchedulePolicy,
        cost: CostModel,
        workload: Workload | RolloutSource,
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
        self.meter = Meter()
        self.snapshots: list[Meter] = [replace(self.meter)]  # one at t=0, then one per step

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
                        rate = self.cost.decode_rate(len(replica.decoding), len(self.running)) * replica.speed
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
                    replica.vclock += self.cost.decode_rate(b, len(self.running)) * replica.speed * dt
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
            if rollout.call < len(rollout.calls):
                self._begin_call(rollout)
            else:
                self._end_rollout(rollout)  # the harness's work after its last call is done
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
            self._begin_step()
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
        if call.gen_tokens == 0:  # no model call: the harness alone works (starts up) tool_s
            self._schedule(self.now + call.tool_s, "tool", rollout)
            return
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
            if rollout.call + 1 < len(rollout.calls) or call.tool_s > 0:
                self._schedule(self.now + call.tool_s, "tool", rollout)
            else:
                self._end_rollout(rollout)

    def _end_rollout(self, rollout: _Rollout) -> None:
        del self.running[id(rollout)]
        rollout.ended_at = self.now
        rollout.served = self.meter.serving - rollout.serving_at_admission
        rollout.replica.assigned -= 1
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
            self._begin_step()
            return
        self._stop_generating(self.cost.kv_dropped_on_switch)
        self.phase = "to_train"
        self._schedule(self.now + self.cost.switch_to_train_s, "to_train")

    def _begin_step(self) -> None:
        """The step over the chosen groups' tokens starts on the training GPUs now."""
        tokens = sum(r.context for g in self.training for r in g.rollouts)
        self._schedule(self.now + self.cost.train_s(tokens, self.train_gpus), "trained")

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
        return measure(
            self.snapshots,
            warmup,
            workload=self.workload.name,
            policy=self.policy,
            stop_reason=self.stop_reason or "",
            gpus=self.layout.gpus,
            gen_gpus=self.gen_gpus,
            train_gpus=self.train_gpus,
            replicas=len(self.replicas),
        )
