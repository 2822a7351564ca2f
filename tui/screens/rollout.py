"""One rollout: summary, calls, the conversation as the model saw it, and the token segments.

Owns laying out a :class:`~tui.detail.RolloutDetail`; building it (samples, decoding) is in
``tui.detail``. Escape goes back to the table.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Static

from tui.detail import RolloutDetail
from tui.widgets.keybar import KeyBar

#: Token segments drawn per rollout (a long agent run is cut with a note).
MAX_SEGMENTS = 400
ROLE_STYLE = {"system": "yellow", "user": "cyan", "assistant": "green", "tool": "blue", "model": "green"}


def summary_text(detail: RolloutDetail) -> Text:
    view = detail.view
    text = Text()
    text.append(f"rollout {view.rollout}", style="bold")
    text.append(f"  {view.purpose}  task {view.task_id}  group {view.group}  adapter {view.adapter}\n")
    style = {"finished": "green", "failed": "red"}.get(view.status, "cyan")
    text.append("status ", style="dim")
    text.append(view.status, style=f"bold {style}")
    if view.error:
        text.append(f" ({view.error})", style="red")
    text.append("  reward ", style="dim")
    text.append("-" if view.reward is None else f"{view.reward:+.3f}", style="bold")
    for reward in view.call_rewards:
        text.append(
            f"  call {reward.call_id[:8]} {reward.name or 'reward'} {reward.reward:+.3f}", style="dim"
        )
    text.append("\nstarted at ", style="dim")
    text.append(f"v{view.created_version}")
    text.append("  trained at step ", style="dim")
    text.append("-" if view.trained_step is None else str(view.trained_step))
    total = sum(c.total_s for c in view.calls)
    queued = sum(c.queue_s for c in view.calls)
    text.append(f"  {len(view.calls)} calls, {total:.2f}s generating, {queued:.2f}s queued", style="dim")
    text.append(f"  {detail.samples} samples")
    for note in detail.truncations:
        text.append(f"\n{note}", style="yellow")
    for note in detail.turn_notes:
        text.append(f"\n{note}", style="red" if ": unmatched," in note else "dim")
    return text


def conversation_text(detail: RolloutDetail) -> Text:
    text = Text()
    text.append(f"conversation ({detail.text_source})\n", style="bold underline")
    for turn in detail.conversation:
        text.append(f"{turn.role}: ", style=f"bold {ROLE_STYLE.get(turn.role, 'white')}")
        text.append(turn.text.rstrip() + "\n")
    return text


def segments_text(detail: RolloutDetail) -> Text:
    text = Text()
    text.append("token segments", style="bold underline")
    text.append("  prompt (mask 0)", style="bright_black")
    text.append("  sampled (mask 1) vN", style="green")
    text.append("  masked stale", style="yellow")
    text.append("\n")
    sample = -1
    for segment in detail.segments[:MAX_SEGMENTS]:
        if segment.sample != sample:
            sample = segment.sample
            text.append(f"sample {sample}\n", style="bold")
        style = "green" if segment.loss_mask else ("bright_black" if segment.version < 0 else "yellow")
        text.append(f"[{segment.start}:{segment.start + len(segment.tokens)}] {segment.label} ", style="dim")
        text.append(f"mask {segment.loss_mask}: ", style="dim")
        text.append(segment.text.replace("\n", "⏎") + "\n", style=style)
    if len(detail.segments) > MAX_SEGMENTS:
        text.append(f"... {len(detail.segments) - MAX_SEGMENTS} more segments\n", style="dim")
    return text


class RolloutScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,backspace", "app.pop_screen", "back")]

    def __init__(self, detail: RolloutDetail) -> None:
        super().__init__()
        self.detail = detail

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="rollout-detail"):
            yield Static(summary_text(self.detail), id="rollout-summary")
            calls: DataTable[str] = DataTable(id="rollout-calls", cursor_type="row")
            calls.add_columns("call", "surface", "prompt", "resp", "finish", "v", "queue", "ttft", "total")
            for call in self.detail.view.calls:
                calls.add_row(
                    call.call_id[:10],
                    call.surface,
                    str(len(call.prompt_ids)),
                    str(len(call.response_ids)),
                    call.finish_reason,
                    str(call.policy_version),
                    f"{call.queue_s * 1000:.0f}ms",
                    f"{call.ttft_s * 1000:.0f}ms",
                    f"{call.total_s * 1000:.0f}ms",
                )
            yield calls
            yield Static(conversation_text(self.detail), id="rollout-conversation")
            yield Static(segments_text(self.detail), id="rollout-segments")
        yield KeyBar([*self.BINDINGS, *self.app.BINDINGS], id="keys")
