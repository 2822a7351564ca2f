"""The simulator fitted to a live run: a cost model and the run's own rollouts, from its events.

Owns pure functions over a run's events (``store.events``; no store, no clock):

* :func:`measure_run`: what the run measured (:class:`RunPhases`): seconds per step over the
  steps after a warm-up, and where they went (generation, the switches, the step);
* :func:`fit_cost`: a :class:`CostModel` of the machine the runs ran on, from every call's
  timing (:func:`fit_decode`, :func:`fit_prefill`), every step's (:func:`fit_train`) and every
  switch's (:func:`fit_switches`);
* :func:`recorded_rollouts`: the rollouts the run made (:class:`RecordedRollouts`), call by
  call: prompt and sampled tokens, and the harness's own time around the calls (its tools and
  the proxy between them, its start-up before the first, scoring and reporting after the last),
  which the simulator replays in the run's admission order, so that it predicts the same run
  rather than a draw like it; :func:`describe_rollouts` sums them up in a few figures.

How each figure is read, and what the runs showed, are in ``docs/scheduler.md`` (section "The
simulator against the appliance"). It runs nothing: ``scripts/compare_modes.py`` runs the
appliance, fits and simulates.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from appliance.scheduler.simulate.costs import CostModel
from appliance.scheduler.simulate.workloads import Call
from store.events import (
    Event,
    LLMCallCompleted,
    RolloutCreated,
    RolloutFinished,
    SwitchPhaseCompleted,
    TrainStepCompleted,
)

#: Switch phases before a collocated step (decision to train until the step starts) and after it
#: (end of the step until the engine serves the new weights), as ``SwitchPhaseCompleted`` names.
TO_TRAIN = ("drain", "sleep", "onload")
TO_GENERATE = ("offload", "wake_weights", "push", "wake_kv_cache")


@dataclass(frozen=True, slots=True)
class RunPhases:
    """What a live run measured over its steps after ``warmup``, in seconds per step."""

    steps: int
    seconds_per_step: float
    #: The engine served (between the end of a switch back and the next switch to training).
    generate: float
    #: Both switches (``TO_TRAIN`` and ``TO_GENERATE`` phases).
    switch: float
    #: The step itself (``SwitchPhaseCompleted(phase="train")``).
    train: float


def measure_run(events: Sequence[Event], warmup: int = 1) -> RunPhases:
    """Seconds per step from the end of step ``warmup``'s training to the end of the last one's
    (the simulator measures between the same instants), and how they split: the switch phases
    and steps that ended inside that window, and the rest, generation."""
    ends = [e.ts for e in events if isinstance(e, SwitchPhaseCompleted) and e.phase == "train"]
    if len(ends) <= warmup:
        raise ValueError(f"only {len(ends)} steps ran; need more than warmup={warmup}")
    start, stop = ends[warmup - 1] if warmup else min(e.ts for e in events), ends[-1]
    steps, span = len(ends) - warmup, stop - start
    phases: dict[str, float] = defaultdict(float)
    for e in events:
        if isinstance(e, SwitchPhaseCompleted) and start < e.ts <= stop:
            phases[e.phase] += e.duration_s
    switch = sum(phases[p] for p in (*TO_TRAIN, *TO_GENERATE))
    return RunPhases(
        steps=steps,
        seconds_per_step=span / steps,
        generate=(span - switch - phases["train"]) / steps,
        switch=switch / steps,
        train=phases["train"] / steps,
    )


# --- the cost model ----------------------------------------------------------------------------


def _intervals(calls: Sequence[LLMCallCompleted]) -> list[tuple[float, float]]:
    """Each call's decoding interval: from its first token to its end."""
    return [(c.ts - c.total_s + c.ttft_s, c.ts) for c in calls]


def _mean_overlap(interval: tuple[float, float], others: Sequence[tuple[float, float]]) -> float:
    """How many of ``others`` (itself included) were under way, on average over ``interval``."""
    a, b = interval
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in others) / (b - a)


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Coefficients minimising the squared error of ``rows @ coef`` against ``ys`` (normal
    equations, Gaussian elimination), or None when the columns are not independent."""
    n = len(rows[0])
    m = [
        [sum(r[i] * r[j] for r in rows) for j in range(n)]
        + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) <= 1e-12 * max(1.0, max(abs(v) for row in m for v in row[:n])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(n):
            if i != col:
                f = m[i][col] / m[col][col]
                m[i] = [a - f * b for a, b in zip(m[i], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nonnegative_fit(columns: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least-squares coefficients of ``ys`` on ``columns``, none negative: the best fit over the
    subsets of columns whose own fit has no negative coefficient (the others at 0); of fits as
    good, the one with fewest columns, the last column (the constant) preferred."""
    best: tuple[float, list[float]] | None = None
    k = len(columns)
    # Fewer columns first, the later (the constant) first among as many: a tie keeps the simpler.
    for mask in sorted(range(1, 2**k), key=lambda m: (bin(m).count("1"), -m)):
        chosen = [i for i in range(k) if mask >> i & 1]
        rows = [[columns[i][j] for i in chosen] for j in range(len(ys))]
        coef = _least_squares(rows, ys)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0] * k
        for i, c in zip(chosen, coef, strict=True):
            full[i] = c
        error = sum((sum(full[i] * columns[i][j] for i in range(k)) - y) ** 2 for j, y in enumerate(ys))
        if best is None or error < best[0] * (1 - 1e-9) - 1e-18:
            best = (error, full)
    if best is None:
        raise ValueError("no fit without a negative coefficient")
    return best[1]


#: The smallest seconds per token per decoding sequence a fit gives the batch term (a decode
#: rate that does not fall with the batch: ``peak_tokens_per_s`` at most 1e9).
_MIN_BATCH_TOKEN_S = 1e-9


def fit_decode(runs: Sequence[Sequence[Event]]) -> tuple[float, float, float]:
    """``(peak_tokens_per_s, b_half, rollout_token_s)`` from the calls' decode rates.

    Each call of more than one token gives the seconds per token its sequence took after the
    first, ``1 / r``, the mean number of calls decoding beside it (itself included), ``b``, and
    the mean number of rollouts alive meanwhile (admitted, not finished), ``n``. The model says
    ``1 / r = b / peak + b_half / peak + rollout_token_s * n``: a plane, fitted by least squares
    with no coefficient below 0 (``peak`` at most 1e9 when the rate does not fall with the
    batch)."""
    batch: list[float] = []
    alive: list[float] = []
    per_token: list[float] = []
    for events in runs:
        timed = [
            e
            for e in events
            if isinstance(e, LLMCallCompleted) and len(e.response_ids) > 1 and e.total_s - e.ttft_s > 0
        ]
        created = {e.rollout: e.ts for e in events if isinstance(e, RolloutCreated)}
        finished = {e.rollout: e.ts for e in events if isinstance(e, RolloutFinished)}
        end = max((e.ts for e in events), default=0.0)
        lives = [(t, finished.get(r, end)) for r, t in created.items()]
        intervals = _intervals(timed)
        batch += [_mean_overlap(i, intervals) for i in intervals]
        alive += [_mean_overlap(i, lives) for i in intervals]
        per_token += [(c.total_s - c.ttft_s) / (len(c.response_ids) - 1) for c in timed]
    if not per_token:
        raise ValueError("no call sampled more than one token: nothing to fit decoding on")
    per_batch, per_rollout, fixed = _nonnegative_fit([batch, alive, [1.0] * len(batch)], per_token)
    per_batch = max(per_batch, _MIN_BATCH_TOKEN_S)
    return 1.0 / per_batch, fixed / per_batch, per_rollout


def fit_prefill(runs: Sequence[Sequence[Event]], *, cached_between_calls: bool) -> float:
    """Prefill tokens/s: prompt tokens over the seconds to the first token (less the gate's
    queue), over the quarter of calls that got their first token soonest per prompt token.

    Only those: the others waited for the processor, the proxy or the engine's next step, not
    for their prefill (on a busy machine most of the time to a first token is that wait, which
    :func:`recorded_rollouts` counts as the harness's time before the call). Without a prefix
    cache between calls (the torch engine) a call prefills its whole prompt; with one, only what
    its rollout's earlier calls did not hold."""
    timed = [
        (float(new if cached_between_calls else len(call.prompt_ids)), call.ttft_s - call.queue_s)
        for events in runs
        for call, new in _new_prompt_tokens([e for e in events if isinstance(e, LLMCallCompleted)])
        if call.ttft_s - call.queue_s > 0
    ]
    if not timed:
        return math.inf
    timed.sort(key=lambda pair: pair[1] / pair[0])
    fastest = timed[: max(1, len(timed) // 4)]
    return sum(t for t, _ in fastest) / sum(s for _, s in fastest)


def _new_prompt_tokens(calls: Sequence[LLMCallCompleted]) -> list[tuple[LLMCallCompleted, int]]:
    """Each call with the prompt tokens its rollout's context did not hold before it (the first
    call's whole prompt; later, what the harness added: tool output, its next message)."""
    out: list[tuple[LLMCallCompleted, int]] = []
    for rollout_calls in _by_rollout(calls).values():
        context = 0
        for call in rollout_calls:
            out.append((call, max(1, len(call.prompt_ids) - context)))
            context = len(call.prompt_ids) + len(call.response_ids)
    return out


def _by_rollout(calls: Iterable[LLMCallCompleted]) -> dict[str, list[LLMCallCompleted]]:
    """Calls by rollout, each rollout's in the order they started."""
    grouped: dict[str, list[LLMCallCompleted]] = defaultdict(list)
    for call in calls:
        grouped[call.rollout].append(call)
    return {r: sorted(cs, key=lambda c: c.ts - c.total_s) for r, cs in grouped.items()}


def fit_train(runs: Sequence[Sequence[Event]], warmup: int = 0) -> tuple[float, float]:
    """``(train_step_s, train_s_per_token)``: a line through each step's ``train`` phase seconds
    against its trained tokens (prompt and sampled, every rollout of the batch; what
    ``TrainStepCompleted.tokens`` counts), the steps after ``warmup`` of every run (the first
    pays for warming up), with no coefficient below 0: a falling line (noise over a narrow range
    of sizes) is the mean step."""
    points: list[tuple[float, float]] = []
    for events in runs:
        seconds = {
            e.step: e.duration_s
            for e in events
            if isinstance(e, SwitchPhaseCompleted) and e.phase == "train" and e.step > warmup
        }
        tokens = {e.step: float(e.tokens) for e in events if isinstance(e, TrainStepCompleted)}
        points += [(tokens[step], seconds[step]) for step in sorted(set(seconds) & set(tokens))]
    if not points:
        raise ValueError("no training step completed: nothing to fit training on")
    slope, intercept = _nonnegative_fit([[t for t, _ in points], [1.0] * len(points)], [s for _, s in points])
    return intercept, slope


def fit_switches(runs: Sequence[Sequence[Event]], warmup: int = 0) -> tuple[float, float]:
    """``(switch_to_train_s, switch_to_generate_s)``: the mean per step of the phases before a
    step and after it (``TO_TRAIN``, ``TO_GENERATE``), the steps after ``warmup`` of every run."""
    before: list[float] = []
    after: list[float] = []
    for events in runs:
        phases: dict[tuple[int, bool], float] = defaultdict(float)
        for e in events:
            if (
                isinstance(e, SwitchPhaseCompleted)
                and e.step > warmup
                and e.phase in (*TO_TRAIN, *TO_GENERATE)
            ):
                phases[e.step, e.phase in TO_TRAIN] += e.duration_s
        before += [seconds for (_, to_train), seconds in phases.items() if to_train]
        after += [seconds for (_, to_train), seconds in phases.items() if not to_train]
    if not before:
        raise ValueError("no switch completed: nothing to fit the switches on")
    return statistics.fmean(before), statistics.fmean(after) if after else 0.0


def fit_cost(
    runs: Sequence[Sequence[Event]],
    *,
    warmup: int = 0,
    cached_between_calls: bool = False,
) -> CostModel:
    """A cost model of the machine the ``runs`` ran on, from all of their events pooled: decode
    (:func:`fit_decode`), prefill (:func:`fit_prefill`), training (:func:`fit_train`) and the
    switches (:func:`fit_switches`). ``cached_between_calls``: whether the engine kept a
    rollout's context between its calls (vLLM's prefix cache; the torch engine keeps none). A
    switch drops the cache either way (``kv_dropped_on_switch``). Steps up to ``warmup`` of each
    run are left out of the training and switch figures."""
    peak, b_half, rollout_token_s = fit_decode(runs)
    train_step_s, train_s_per_token = fit_train(runs, warmup)
    to_train, to_generate = fit_switches(runs, warmup)
    return CostModel(
        peak_tokens_per_s=peak,
        b_half=b_half,
        prefill_tokens_per_s=fit_prefill(runs, cached_between_calls=cached_between_calls),
        train_step_s=train_step_s,
        train_s_per_token=train_s_per_token,
        switch_to_train_s=to_train,
        switch_to_generate_s=to_generate,
        kv_dropped_on_switch=True,
        rollout_token_s=rollout_token_s,
    )


# --- the rollouts ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordedRollouts:
    """The training rollouts of a live run, by group in admission order, each as its calls: the
    prompt tokens its context did not hold before the call, the tokens sampled, and the seconds
    from the call's end to the next one's start (the harness's tools and its own work); after
    the last call, the seconds until the rollout finished (scoring, reporting the reward).

    Stands in for a :class:`Workload`: ``draw_group`` hands out the recorded groups in order,
    one per call, as the simulator admits them (so one instance serves one simulation: build
    one per run with :meth:`fresh`). Past the recorded groups it starts over from the first."""

    name: str
    groups: tuple[tuple[tuple[Call, ...], ...], ...]
    _next: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def fresh(self) -> RecordedRollouts:
        """The same groups, handed out from the first again."""
        return RecordedRollouts(self.name, self.groups)

    def draw_group(self, rng: random.Random, size: int) -> list[tuple[Call, ...]]:
        """The next recorded group (``rng`` unused: nothing is drawn)."""
        group = self.groups[self._next[0] % len(self.groups)]
        self._next[0] += 1
        if len(group) != size:
            raise ValueError(f"recorded groups have {len(group)} rollouts; the simulation asks {size}")
        return list(group)


def recorded_rollouts(
    events: Sequence[Event], name: str = "recorded", *, prefill_tokens_per_s: float = math.inf
) -> RecordedRollouts:
    """The run's training rollouts (validation and evaluation rollouts left out), by group in
    the order they were admitted. A rollout still running when the run stopped keeps the calls
    it made; a group with fewer rollouts than the others (cut short) is left out.

    A call counts as reaching the engine once its time to the first token, less the gate's queue
    (a switch: the simulator holds it itself) and its prefill at ``prefill_tokens_per_s``
    (the simulator's own), has passed: that latency (the proxy rendering and tokenizing the
    request, the harness's HTTP, the wait for the engine's next step) is the harness's time
    before the call, with its tools (after a call) or its start-up (before the first)."""
    created = [e for e in events if isinstance(e, RolloutCreated) and e.purpose == "train"]
    finished = {e.rollout: e.ts for e in events if isinstance(e, RolloutFinished)}
    calls = _by_rollout(e for e in events if isinstance(e, LLMCallCompleted))
    groups: dict[str, list[tuple[Call, ...]]] = {}
    for rollout in created:
        made = calls.get(rollout.rollout, [])
        if not made:
            continue
        new_tokens = [n for _, n in _new_prompt_tokens(made)]
        arrivals = [
            c.ts - c.total_s + max(0.0, c.ttft_s - c.queue_s - n / prefill_tokens_per_s)
            for c, n in zip(made, new_tokens, strict=True)
        ]
        start_up = arrivals[0] - rollout.ts
        out: list[Call] = [Call(0, 0, start_up)] if start_up > 0 else []
        for i, call in enumerate(made):
            after = arrivals[i + 1] if i + 1 < len(made) else finished.get(rollout.rollout, call.ts)
            out.append(Call(new_tokens[i], max(1, len(call.response_ids)), max(0.0, after - call.ts)))
        groups.setdefault(rollout.group, []).append(tuple(out))
    size = max((len(g) for g in groups.values()), default=0)
    complete = tuple(tuple(g) for g in groups.values() if len(g) == size)
    if not complete:
        raise ValueError("the run made no training call: no rollouts to replay")
    return RecordedRollouts(name, complete)


def describe_rollouts(recorded: RecordedRollouts) -> dict[str, float]:
    """The recorded rollouts in a few figures: model calls per rollout (mean, median, p90, max),
    sampled tokens per call, and the harness's seconds between calls (median, p90, mean),
    before its first call and after its last (means)."""
    rollouts = [calls for group in recorded.groups for calls in group]
    model_calls = [[c for c in calls if c.gen_tokens > 0] for calls in rollouts]
    counts = sorted(len(calls) for calls in model_calls)
    between = sorted(c.tool_s for calls in model_calls for c in calls[:-1])
    start_up = [calls[0].tool_s if calls[0].gen_tokens == 0 else 0.0 for calls in rollouts]

    def quantile(values: Sequence[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    return {
        "rollouts": float(len(rollouts)),
        "calls_mean": statistics.fmean(counts),
        "calls_p50": float(quantile(counts, 0.5)),
        "calls_p90": float(quantile(counts, 0.9)),
        "calls_max": float(counts[-1]),
        "gen_tokens_mean": statistics.fmean(c.gen_tokens for calls in model_calls for c in calls),
        "tool_s_p50": quantile(between, 0.5),
        "tool_s_p90": quantile(between, 0.9),
        "tool_s_mean": statistics.fmean(between) if between else 0.0,
        "start_up_s_mean": statistics.fmean(start_up),
        "wrap_up_s_mean": statistics.fmean(calls[-1].tool_s for calls in model_calls),
    }
