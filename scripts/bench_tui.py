"""Dashboard responsiveness: key press -> redraw latency while the log grows at 1,000 events/s.

A writer process appends events to a real store (``EventStore``, group commit) at a steady rate,
shaped like a busy run: rollouts created, multi-call rollouts (each call's prompt extends the
previous one), rewards, finishes, and a training step every few seconds. The dashboard follows
the same file (``SqliteSource``, as ``up`` and ``tui --db`` do) in this process, driven by
Textual's Pilot at 160x48. Each key press switches tabs (1 -> 2 -> 3 -> 4 -> ...; a first round
that lays out each tab once is not counted); its latency is the time from the press to the first
frame composed and rendered to terminal bytes with the new tab on screen (``App._display`` is
wrapped to render the frame as a terminal would, since the headless driver skips that).
Measured twice in one run, side by side: with the writer idle and with it appending, printed as
p50 / p99 / max and their ratio, with the append rate achieved and how far the dashboard lagged.

    .venv/bin/python scripts/bench_tui.py [--rate 1000] [--presses 100]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from textual._compositor import CompositorUpdate
from textual.widgets import TabbedContent

from store.events import (
    ApplianceStarted,
    Event,
    LLMCallCompleted,
    PhaseChanged,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    TrainStepCompleted,
)
from store.eventstore import EventStore
from store.tokens import Tokens
from tui.app import DashboardApp
from tui.source import SqliteSource
from tui.system import SystemSampler

TABS = ("overview", "curves", "rollouts", "events")


def run_events(index: int, now: float) -> list[Event]:
    """The events of rollout ``index``: created, three calls, a reward, finished (6 events)."""
    rollout = f"r{index:07d}"
    prompt: tuple[int, ...] = tuple(range(40))
    group = f"g{index // 4}"
    out: list[Event] = [
        RolloutCreated(
            ts=now, rollout=rollout, task_id=group, group=group, task={}, policy_version=0, adapter="python"
        )
    ]
    for k in range(3):
        response = tuple(1000 + (index + k + j) % 500 for j in range(24))
        out.append(
            LLMCallCompleted(
                ts=now, rollout=rollout, call_id=f"{rollout}-{k}", surface="openai.chat",
                prompt_ids=Tokens(prompt), response_ids=Tokens(response),
                response_logprobs=(-0.5,) * len(response), policy_version=0,
                finish_reason="stop", request={"messages": [{"role": "user", "content": "q"}]},
                response_text="a", queue_s=0.001, total_s=0.05,
            )
        )  # fmt: skip
        prompt = prompt + response + (7, 8)
    out.append(RewardReported(ts=now, rollout=rollout, reward=float(index % 2), source="bench"))
    out.append(RolloutFinished(ts=now, rollout=rollout, status="finished", duration_s=0.2))
    return out


async def write(path: Path, rate: float, ready: MpEvent, stop: MpEvent, result: Any) -> None:
    async with await EventStore.open(path) as store:
        await store.append(
            [
                ApplianceStarted(
                    ts=time.time(), run_id="bench", model="tiny", engine="torch", resumed_from_version=0,
                    resumed_from_step=0,
                ),
                PhaseChanged(ts=time.time(), phase="generate", policy_version=0),
            ]
        )  # fmt: skip
        ready.set()
        tick = 0.02
        written, rollout, step = 0, 0, 0
        pending: list[Event] = []
        started = time.perf_counter()
        next_at = started
        while not stop.is_set():
            due = int((time.perf_counter() - started) * rate) - written
            while len(pending) < due:
                pending += run_events(rollout, time.time())
                rollout += 1
                if rollout % 200 == 0:
                    step += 1
                    metrics = {"loss": 1.0 / step, "reward_mean": 0.5, "entropy": 1.0, "grad_norm": 1.0}
                    pending.append(
                        TrainStepCompleted(
                            ts=time.time(), step=step, rollouts=(), samples=0, tokens=0,
                            zero_variance_groups=0, metrics=metrics,
                        )
                    )  # fmt: skip
            if due > 0:
                batch, pending = pending[:due], pending[due:]
                await store.append(batch)
                written += len(batch)
            next_at += tick
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        elapsed = time.perf_counter() - started
        result.put((written, elapsed, store.last_position))


def writer_main(path: str, rate: float, ready: MpEvent, stop: MpEvent, result: Any) -> None:
    asyncio.run(write(Path(path), rate, ready, stop, result))


class TimedDashboard(DashboardApp):
    """Renders each frame to terminal bytes (as a real terminal driver would) and records when."""

    frames: list[tuple[float, str]]
    frame_drawn: asyncio.Event

    def _display(self, screen: Any, renderable: Any) -> None:
        if isinstance(renderable, CompositorUpdate):
            renderable.render_segments(self.console)
            active = self.query_one("#tabs", TabbedContent).active if screen is self.screen else ""
            self.frames.append((time.perf_counter(), active))
            self.frame_drawn.set()
        super()._display(screen, renderable)


async def measure(db: Path, presses: int) -> tuple[list[float], int]:
    """Latencies (s) of ``presses`` tab switches, and the events folded at the last one."""
    # As ``lightning-appliance tui`` runs it: its own process, folded events frozen out of the GC.
    app = TimedDashboard(
        SqliteSource(db, live=True), usage=SystemSampler().sample, find_tokenizer=False, freeze_gc=True
    )
    app.frames = []
    app.frame_drawn = asyncio.Event()
    latencies: list[float] = []
    async with app.run_test(size=(160, 48)) as pilot:
        await app.caught_up.wait()
        await pilot.pause()
        for i in range(len(TABS) + presses):  # the first round visits each tab once, unmeasured
            target = TABS[(i + 1) % len(TABS)]
            seen = len(app.frames)
            start = time.perf_counter()
            await pilot.press(str(TABS.index(target) + 1))
            while not any(tab == target for _, tab in app.frames[seen:]):
                app.frame_drawn.clear()
                await app.frame_drawn.wait()
            frame_at = next(t for t, tab in app.frames[seen:] if tab == target)
            if i >= len(TABS):
                latencies.append(frame_at - start)
            await asyncio.sleep(0.05)  # a person does not press 100 keys a second
        position = app.model.position
    return latencies, position


def summary(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1000, p99 * 1000, ordered[-1] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="events appended per second")
    parser.add_argument("--presses", type=int, default=100)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "events.sqlite"
        results: dict[str, tuple[float, float, float]] = {}

        idle_db = Path(tmp) / "idle.sqlite"
        asyncio.run(_seed(idle_db))
        idle, _ = asyncio.run(measure(idle_db, args.presses))
        results["idle log"] = summary(idle)

        ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        writer = ctx.Process(target=writer_main, args=(str(db), args.rate, ready, stop, out))
        writer.start()
        ready.wait(30)
        loaded, seen = asyncio.run(measure(db, args.presses))
        stop.set()
        written, elapsed, last = out.get(timeout=30)
        writer.join(30)
        results[f"{args.rate:.0f} events/s"] = summary(loaded)

    print(f"key press -> redraw latency over {args.presses} tab switches at 160x48 (ms)")
    print(f"{'log':<18} {'p50':>8} {'p99':>8} {'max':>8}")
    for name, (p50, p99, worst) in results.items():
        print(f"{name:<18} {p50:8.1f} {p99:8.1f} {worst:8.1f}")
    (i50, i99, _), (l50, l99, _) = results.values()
    print(f"loaded / idle: p50 x{l50 / i50:.2f}  p99 x{l99 / i99:.2f}")
    print(
        f"appended {written} events in {elapsed:.1f}s = {written / elapsed:.0f} events/s; "
        f"the dashboard had folded {seen} of {last} at its last press"
    )
    verdict = "PASS" if l99 < 100 else "FAIL"
    print(f"{verdict}: p99 under load {l99:.1f} ms (target < 100 ms)")


async def _seed(path: Path) -> None:
    async with await EventStore.open(path) as store:
        events: list[Event] = []
        for i in range(2000):
            events += run_events(i, time.time())
        await store.append(events)


if __name__ == "__main__":
    main()
