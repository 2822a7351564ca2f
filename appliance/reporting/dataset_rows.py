"""The two row shapes of a dataset export: ``sft`` (a rollout's conversation in OpenAI chat form)
and ``tokens`` (one row per trained sample), with their Parquet schemas.

Owns building a row from a rollout and the replay of what a training step was given
(:func:`trained_rollouts`: samples, staleness mask and advantages with the settings the run
recorded). It does not own the filters, the writers nor the pass over the log
(``appliance.reporting.export``), nor the samples and advantages themselves (``trainer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]

from appliance.chat.messages import (
    Message,
    ToolCall,
    messages_from_openai,
    tool_schema_names,
    tools_from_openai,
)
from appliance.chat.tools import parse_assistant
from appliance.config import SchedulerConfig, TrainerConfig, recorded_value
from appliance.training.batch import step_batch
from contracts.errors import ApplianceError
from store.events import LLMCallCompleted, TrainStepCompleted
from store.outcomes import reason_of
from store.projections import RolloutView, RunState
from trainer.samples import Sample

_MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        (
            "tool_calls",
            pa.list_(
                pa.struct(
                    [
                        ("id", pa.string()),
                        ("type", pa.string()),
                        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
                    ]
                )
            ),
        ),
        ("tool_call_id", pa.string()),
    ]
)
_ROLLOUT_COLUMNS = [
    ("rollout_id", pa.string()),
    ("task_id", pa.string()),
    ("group", pa.string()),
    ("purpose", pa.string()),
    ("reward", pa.float64()),
    ("step", pa.int64()),
]
SFT_SCHEMA = pa.schema(
    [
        ("messages", pa.list_(_MESSAGE)),
        ("tools", pa.string()),
        *_ROLLOUT_COLUMNS,
        ("status", pa.string()),
        ("failure_reason", pa.string()),
        ("policy_version", pa.int64()),
        ("calls", pa.int64()),
        ("surface", pa.string()),
        ("finish_reason", pa.string()),
    ]
)
TOKENS_SCHEMA = pa.schema(
    [
        *_ROLLOUT_COLUMNS,
        ("policy_version", pa.int64()),
        ("sample_index", pa.int64()),
        ("call_ids", pa.list_(pa.string())),
        ("prompt_ids", pa.list_(pa.int64())),
        ("response_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float64())),
        ("versions", pa.list_(pa.int64())),
        ("advantage", pa.float64()),
        ("truncation", pa.string()),
    ]
)

Row = dict[str, Any]
#: Characters of a failed rollout's reason kept in its row (``store.projections.one_line``).
FAILURE_WIDTH = 300


def _message_json(message: Message) -> Row:
    """A message in the OpenAI chat shape."""
    out: Row = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def _conversation(call: LLMCallCompleted) -> tuple[list[Message], list[dict[str, Any]]] | None:
    """The call's request as messages and tools, from any chat surface; None when the request is
    not a chat (a text completion) or continues a stored response the log alone cannot expand."""
    request = call.request
    if call.surface == "openai.chat":
        return messages_from_openai(list(request.get("messages") or [])), tools_from_openai(
            request.get("tools")
        )
    if call.surface.startswith("anthropic"):
        from appliance.proxy.anthropic_messages import to_messages, to_tools

        return to_messages(request), to_tools(request)
    if call.surface == "openai.responses" and not request.get("previous_response_id"):
        from appliance.proxy.openai_responses import messages_from_input, tools_from_responses

        messages = messages_from_input(request.get("instructions"), request.get("input"))
        return messages, tools_from_responses(request.get("tools"))
    return None


def sft_row(view: RolloutView, step: int | None) -> Row | None:
    """The rollout's conversation as the harness saw it last, with the final answer (None: see
    :func:`_conversation`, or no call)."""
    if not view.calls:
        return None
    last = view.calls[-1]
    try:
        conversation = _conversation(last)
    except ApplianceError:  # a request the proxy refused to read is not in the log; be safe
        return None
    if conversation is None:
        return None
    messages, tools = conversation
    answer = parse_assistant(last.response_text, tool_schema_names(tools))
    # Tool call ids are the proxy's random ones, not recorded: name them after the call instead.
    calls = tuple(
        ToolCall(f"{last.call_id}-{i}", c.name, c.arguments) for i, c in enumerate(answer.tool_calls)
    )
    final = Message("assistant", answer.content, calls)
    return {
        "messages": [_message_json(m) for m in [*messages, final]],
        "tools": tools,
        **_rollout_columns(view, step),
        "status": view.status,
        # Why it failed, on one line as ``status --failures`` says it (None: it did not fail).
        "failure_reason": reason_of(view, FAILURE_WIDTH) if view.status == "failed" else None,
        "policy_version": view.created_version,
        "calls": len(view.calls),
        "surface": last.surface,
        "finish_reason": last.finish_reason,
    }


def _rollout_columns(view: RolloutView, step: int | None) -> Row:
    return {
        "rollout_id": view.rollout,
        "task_id": view.task_id,
        "group": view.group,
        "purpose": view.purpose,
        "reward": view.reward,
        "step": step,
    }


@dataclass(frozen=True, slots=True)
class TrainedRollout:
    """One rollout as a training step was given it: its samples and advantage."""

    view: RolloutView
    advantage: float
    samples: tuple[Sample, ...]


def trained_rollouts(state: RunState, step: TrainStepCompleted) -> list[TrainedRollout]:
    """What the training service built for ``step`` from ``state`` (the run folded up to just
    before the step's event, calls still held), by the same ``appliance.training.batch.step_batch``
    with the run's recorded settings: the trainable rollouts of the step's groups in the same
    order, their advantages and their staleness-masked samples."""
    config = state.last_start.config if state.last_start is not None else {}
    advantage = recorded_value(config, "advantage") or TrainerConfig().advantage
    mode = recorded_value(config, "mode") or SchedulerConfig().mode
    eta_value = recorded_value(config, "eta")
    eta = (int(eta_value) if eta_value is not None else SchedulerConfig().eta) if mode == "async" else None
    drop_stale = (recorded_value(config, "stale_tokens") or SchedulerConfig().stale_tokens) == "drop"
    views = [state.rollouts[r] for r in step.rollouts if r in state.rollouts]
    batch = step_batch(
        views, policy_version=state.policy_version, advantage=advantage, eta=eta, drop_stale=drop_stale
    )
    return [
        TrainedRollout(view, item.advantage, item.samples)
        for view, item in zip(batch.trainable, batch.items, strict=True)
    ]


def token_rows(trained: TrainedRollout, step: int, policy_version: int) -> Iterator[Row]:
    """One row per sample of a trained rollout (``policy_version``: the version the step updated)."""
    prompts = {call.call_id: len(call.prompt_ids) for call in trained.view.calls}
    for index, sample in enumerate(trained.samples):
        cut = min(prompts[sample.call_ids[0]], len(sample.tokens)) if sample.call_ids else 0
        yield {
            **_rollout_columns(trained.view, step),
            "policy_version": policy_version,
            "sample_index": index,
            "call_ids": list(sample.call_ids),
            "prompt_ids": list(sample.tokens[:cut]),
            "response_ids": list(sample.tokens[cut:]),
            "loss_mask": list(sample.loss_mask[cut:]),
            "logprobs": list(sample.logprobs[cut:]),
            "versions": list(sample.versions[cut:]),
            "advantage": trained.advantage,
            "truncation": sample.truncation,
        }
