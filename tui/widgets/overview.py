"""The overview panel: phase and its timeline, policy version, rollouts (failures with their
reasons), rates, staleness, machine, and, while the circuit breaker holds admissions, why and
until when.

Owns laying out those figures as rich text; every figure comes from ``tui.model`` (and the
machine usage the app samples). Renders only when the model's revision or the usage changed.
A live run shows its recent rates and the machine; a run that stopped, or one opened from its
file (``tui --db``), shows its own figures over its life (``DashboardModel.life``) and why it
stopped, and no machine: this machine's figures say nothing about that run.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from store.projections import one_line
from tui.model import DashboardModel, PhaseSpan
from tui.system import Usage

#: Style and short name of each phase on the timeline.
PHASE_STYLES = {"generate": "green", "switch": "yellow", "train": "magenta", "idle": "bright_black"}
SHORT = {"generate": "gen", "switch": "switch", "train": "train", "idle": "idle"}


def _fmt_s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    if seconds >= 60:
        return f"{seconds / 60:.1f}m"
    return f"{seconds:.1f}s"


def timeline_bar(spans: list[PhaseSpan], now: float, width: int) -> Text:
    """The most recent spans as coloured blocks, each at least one cell, proportional in time."""
    bar = Text()
    if not spans or width <= 0:
        return bar
    total = sum(s.duration(now) for s in spans) or 1.0
    cells = [max(1, round(s.duration(now) / total * width)) for s in spans]
    while sum(cells) > width and len(cells) > 1:  # drop the oldest spans that do not fit
        cells.pop(0)
        spans = spans[1:]
    for span, n in zip(spans, cells, strict=True):
        bar.append("█" * n, style=PHASE_STYLES.get(span.phase, "white"))
    return bar


def breaker_lines(text: Text, model: DashboardModel, now: float, width: int) -> None:
    """Two lines while the circuit breaker's back-off runs at ``now``: the failures, when
    admissions resume, and the last failure's reason on one line; nothing otherwise."""
    trip = model.state.admissions_paused_at(now)
    if trip is None:
        return
    text.append("ADMISSIONS PAUSED", style="bold red")
    text.append(
        f"  {trip.failures} training rollouts failed in a row"
        + (f" (trip {trip.trips} in a row)" if trip.trips > 1 else "")
        + f"; resume in {_fmt_s(trip.ts + trip.backoff_s - now)}\n"
    )
    text.append("cause ", style="dim")
    text.append(one_line(trip.cause, max(width - 8, 40)) or "-", style="red")
    text.append("\n")


def life_lines(text: Text, model: DashboardModel) -> None:
    """The run's own figures over its life: how long it ran, its totals with their mean rates
    over that time, its steps and how its rewards went (first → last)."""
    life = model.life()
    text.append("ran ", style="dim")
    text.append(_fmt_s(life.run_s), style="bold")
    text.append("  calls ", style="dim")
    text.append(f"{life.calls}", style="bold")
    text.append(f" ({life.calls_s:.2f}/s)  ")
    text.append("tokens sampled ", style="dim")
    text.append(f"{life.sampled}", style="bold")
    text.append(f" ({life.tokens_s:.1f}/s)  ")
    text.append("trained ", style="dim")
    text.append(f"{life.trained}", style="bold")
    text.append("  ")
    text.append("steps ", style="dim")
    text.append(f"{life.steps}", style="bold")
    text.append("\n")
    trends = [(label, t) for label, t in (("reward", life.reward), ("validation", life.validation)) if t]
    for i, (label, (first, last)) in enumerate(trends):
        text.append(("  " if i else "") + f"{label} ", style="dim")
        text.append(f"{first:.3f} → {last:.3f}", style="bold")
    if trends:
        text.append("\n")


class OverviewPanel(Static):
    """Headline figures of the run."""

    DEFAULT_CLASSES = "panel"

    def show(self, model: DashboardModel, now: float, usage: list[Usage], live: bool) -> None:
        self.update(self.render_text(model, now, usage, live, self.size.width or 78))

    @staticmethod
    def render_text(model: DashboardModel, now: float, usage: list[Usage], live: bool, width: int) -> Text:
        state = model.state
        text = Text()
        phase = state.phase.upper()
        text.append("phase ", style="dim")
        text.append(f"{phase:<8}", style=f"bold {PHASE_STYLES.get(state.phase, 'white')}")
        if state.paused:
            text.append(" PAUSED", style="bold red")
        text.append("  policy ", style="dim")
        text.append(f"v{state.policy_version}", style="bold")
        text.append("  step ", style="dim")
        text.append(f"{state.step}", style="bold")
        if model.stopped:
            text.append(f"  {model.stop_text()}", style="red")
        elif not live:
            text.append("  (read-only)", style="dim")
        text.append("\n")
        breaker_lines(text, model, now, width)
        if model.model:
            text.append(f"model {model.model} on {model.engine}  run {state.run_id[:12]}\n", style="dim")
        if model.agents:
            unsandboxed = model.agents.startswith("agents run unsandboxed")
            text.append(f"{model.agents}\n", style="bold yellow" if unsandboxed else "dim")

        counts = model.counts()
        text.append("rollouts ", style="dim")
        for label, value, style in (
            ("offered", counts.offered, "blue"),
            ("running", counts.running, "cyan"),
            ("finished", counts.finished, "green"),
            ("failed", counts.failed, "red"),
            ("to train", counts.awaiting_training, "yellow"),
        ):
            text.append(f"{label} ")
            text.append(f"{value}", style=f"bold {style}")
            text.append("  ")
        text.append("\n")
        if counts.failed:
            text.append(one_line(model.failures(), max(width - 2, 40)) + "\n", style="red")

        if live and not model.stopped:
            calls_s, tokens_s = model.rates(now)
            text.append("calls/s ", style="dim")
            text.append(f"{calls_s:.2f}", style="bold")
            text.append("  sampled tokens/s ", style="dim")
            text.append(f"{tokens_s:.1f}", style="bold")
            text.append("  ")
        else:
            life_lines(text, model)
        stale = model.staleness()
        text.append("staleness ", style="dim")
        if stale:
            text.append(
                f"{stale.get('staleness_mean', 0.0):.2f} v, {stale.get('stale_tokens', 0):.0f} stale tok"
                f" ({stale.get('stale_tokens_dropped', 0):.0f} dropped)"
            )
        else:
            text.append("-")
        text.append("\n")
        if live:  # the machine the dashboard runs on: the run's only while it is live
            for item in usage:
                text.append(item.text() + "\n", style="")

        spans = list(model.timeline)
        text.append("timeline ", style="dim")
        for phase in ("generate", "switch", "train"):
            text.append("■ ", style=PHASE_STYLES[phase])
            text.append(f"{phase}  ", style="dim")
        text.append("\n")
        text.append_text(timeline_bar(spans[-40:], now, max(width - 2, 10)))
        text.append("\n")
        recent = spans[-6:]
        for i, span in enumerate(recent):
            text.append(SHORT.get(span.phase, span.phase), style=PHASE_STYLES.get(span.phase, "white"))
            text.append(f" {_fmt_s(span.duration(now))}" + ("" if span.end is not None else "…"))
            if i < len(recent) - 1:
                text.append(" › ", style="dim")
        text.append("\n")
        totals = model.phase_totals(now)
        if totals:
            text.append("total ", style="dim")
            text.append("  ".join(f"{SHORT.get(k, k)} {_fmt_s(v)}" for k, v in totals.items()))
            text.append("\n")

        last_ckpt = state.last_checkpoint
        text.append("checkpoint ", style="dim")
        text.append(last_ckpt.path if last_ckpt else (state.checkpoint or "-"))
        if model.controls:
            last = model.controls[-1]
            text.append("  last control ", style="dim")
            text.append(f"{last.action} ({last.source})")
        return text
