"""``lightning-appliance export``: a real run's rollouts as datasets.

The ``tokens`` rows are held to what the trainer was given at the step (recorded by wrapping the
trainer's ``step``); the ``sft`` rows replay through the proxy's own chat rendering to the prompt
ids the last call was sampled after; both load with ``datasets``; the export reads a live store
(open, WAL) and a backup of it alike. Filters and the one-line errors run on a small log written
by hand (tests/appliance/export_log.py), and so does the memory bound.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from appliance.app import Appliance
from appliance.chat.messages import messages_from_openai, tool_schema_names, tools_from_openai
from appliance.chat.tools import parse_assistant
from appliance.chat.transcript import Transcript
from appliance.cli import main
from appliance.operations.backup import backup
from appliance.reporting.export import ExportFilter, export_dataset
from store import reading
from store.events import LLMCallCompleted
from store.eventstore import read_events_sync
from tests.appliance.export_log import write_log
from tests.support import make_config
from trainer.items import StepOutput, TrainItem


def rows(path: Path) -> list[dict[str, Any]]:
    """A JSONL file's rows, or a Parquet file's (with ``tools`` read back from its JSON text)."""
    if path.suffix == ".parquet":
        out = pq.read_table(path).to_pylist()
        for row in out:
            if "tools" in row:
                row["tools"] = json.loads(row["tools"])
                row["messages"] = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        return list(out)
    return [json.loads(line) for line in path.read_text().splitlines()]


def export(data_dir: Path, out: Path, shape: str, **where: Any) -> list[dict[str, Any]]:
    fmt = "parquet" if out.suffix == ".parquet" else "jsonl"
    export_dataset(data_dir, out, shape=shape, fmt=fmt, where=ExportFilter(**where))
    return rows(out)


async def test_a_real_runs_export_is_what_the_trainer_trained_and_what_the_harness_saw(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    given: list[TrainItem] = []
    config = make_config(tmp_path, tiny_model_dir, max_steps=1)
    data_dir = config.data_dir
    out = tmp_path / "out"
    async with Appliance(config) as app:
        trainer: Any = app.training.trainer
        step = trainer.step

        def recording(items: Sequence[TrainItem]) -> StepOutput:
            given.extend(items)
            return step(items)  # type: ignore[no-any-return]

        trainer.step = recording
        assert await app.run() == "reached step 1"
        # The store is open (WAL, the writer live): the export reads it read-only.
        live = {
            name: export(data_dir, out / name, shape)
            for name, shape in [
                ("tokens.jsonl", "tokens"),
                ("tokens.parquet", "tokens"),
                ("sft.jsonl", "sft"),
                ("sft.parquet", "sft"),
            ]
        }
        tokenizer, fmt = app.registry._tokenizer, app.registry.fmt

    events = [s.event for s in read_events_sync(data_dir / "events.sqlite")]
    calls: dict[str, list[LLMCallCompleted]] = {}
    for event in events:
        if isinstance(event, LLMCallCompleted):
            calls.setdefault(event.rollout, []).append(event)
    prompts = {call.call_id: call.prompt_ids for recorded in calls.values() for call in recorded}

    # tokens: one row per sample the trainer was given, equal field by field.
    assert given and all(item.samples for item in given)
    expected = [
        {
            "rollout_id": item.rollout,
            "sample_index": i,
            "step": 1,
            "policy_version": 0,
            "call_ids": list(sample.call_ids),
            "ids": list(sample.tokens),
            "loss_mask": list(sample.loss_mask),
            "logprobs": list(sample.logprobs),
            "versions": list(sample.versions),
            "reward": item.reward,
            "advantage": item.advantage,
        }
        for item in given
        for i, sample in enumerate(item.samples)
    ]
    for name in ("tokens.jsonl", "tokens.parquet"):
        got = []
        for row in live[name]:
            prompt = row["prompt_ids"]
            # The prompt part is the prompt of the sample's first call.
            assert prompt == list(prompts[row["call_ids"][0]])
            got.append(
                {
                    "rollout_id": row["rollout_id"],
                    "sample_index": row["sample_index"],
                    "step": row["step"],
                    "policy_version": row["policy_version"],
                    "call_ids": row["call_ids"],
                    "ids": prompt + row["response_ids"],
                    "loss_mask": [0] * len(prompt) + row["loss_mask"],
                    "logprobs": [0.0] * len(prompt) + row["logprobs"],
                    "versions": [-1] * len(prompt) + row["versions"],
                    "reward": row["reward"],
                    "advantage": row["advantage"],
                }
            )
        assert got == expected, name

    # sft: one row per rollout; the conversation renders to the last call's prompt ids.
    assert {r["rollout_id"] for r in live["sft.jsonl"]} == {item.rollout for item in given}
    for row in live["sft.jsonl"]:
        assert set(row) >= {"messages", "tools", "rollout_id", "task_id", "reward", "purpose", "step"}
        assert row["purpose"] == "train" and row["step"] == 1 and row["status"] == "finished"
        assert row["reward"] == next(i.reward for i in given if i.rollout == row["rollout_id"])
        recorded = calls[row["rollout_id"]]
        transcript = Transcript(tokenizer, fmt)
        # The proxy's rendering, replayed: the earlier calls as recorded, each answer remembered.
        for call in recorded[:-1]:
            tools = tools_from_openai(call.request.get("tools"))
            rendered = transcript.render_chat(messages_from_openai(list(call.request["messages"])), tools)
            assert rendered.prompt_ids == call.prompt_ids
            answer = parse_assistant(call.response_text, tool_schema_names(tools))
            transcript.remember(
                rendered, answer, call.response_ids, call.response_text, (tokenizer.im_end_id,), None
            )
        *conversation, final = row["messages"]
        rendered = transcript.render_chat(messages_from_openai(conversation), tools_from_openai(row["tools"]))
        assert rendered.prompt_ids == recorded[-1].prompt_ids
        assert final["role"] == "assistant"
        assert final["content"] in recorded[-1].response_text
    assert rows(out / "sft.parquet") == live["sft.jsonl"]

    # Both load with datasets, as a trainer would read them.
    for name, loader in [
        ("sft.jsonl", "json"),
        ("tokens.jsonl", "json"),
        ("sft.parquet", "parquet"),
        ("tokens.parquet", "parquet"),
    ]:
        loaded = datasets.load_dataset(loader, data_files=str(out / name), split="train")
        assert loaded.num_rows == len(live[name]), name
    loaded = datasets.load_dataset("json", data_files=str(out / "sft.jsonl"), split="train")
    assert loaded[0]["messages"][0]["role"] == "system"

    # Owner-only, as the run's own files (data_umask 077).
    assert {f"{(out / name).stat().st_mode & 0o777:o}" for name in live} == {"600"}

    # A backup of the run exports the same rows.
    copy = tmp_path / "copy"
    backup(data_dir, copy)
    for name, shape in [("tokens.jsonl", "tokens"), ("sft.jsonl", "sft")]:
        assert export(copy, tmp_path / "from-backup" / name, shape) == live[name]


# --- filters, on a log written by hand ---------------------------------------------------------------


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    """Two steps of two groups of two, a failed rollout, a validation round (export_log.py)."""
    write_log(tmp_path / "run", steps=2)
    return tmp_path / "run"


def ids(found: list[dict[str, Any]]) -> list[str]:
    return sorted({r["rollout_id"] for r in found})


def test_by_default_sft_has_every_finished_rollout_and_tokens_every_trained_one(
    log_dir: Path, tmp_path: Path
) -> None:
    sft = export(log_dir, tmp_path / "a.jsonl", "sft")
    assert ids(sft) == ["s1-g0-r0", "s1-g0-r1", "s1-g1-r0", "s2-g0-r0", "s2-g0-r1", "s2-g1-r0", "val-0"]
    tokens = export(log_dir, tmp_path / "b.jsonl", "tokens")
    assert ids(tokens) == ids(sft)[:-1]
    # The advantages are the group's (GRPO): a two-rollout group +-1, a lone finished one 0.
    advantages = {r["rollout_id"]: round(r["advantage"], 4) for r in tokens}
    assert advantages["s1-g0-r0"] == -advantages["s1-g0-r1"] != 0
    assert advantages["s1-g1-r0"] == 0.0


def test_filters(log_dir: Path, tmp_path: Path) -> None:
    def sft(**where: Any) -> list[str]:
        return ids(export(log_dir, tmp_path / "x.jsonl", "sft", **where))

    assert sft(purposes=frozenset({"validation"})) == ["val-0"]
    assert sft(statuses=("failed",)) == ["s1-g1-r1", "s2-g1-r1"]
    assert sft(min_reward=0.5) == ["s1-g0-r1", "s2-g0-r1", "val-0"]
    assert sft(steps=(2, 2)) == ["s2-g0-r0", "s2-g0-r1", "s2-g1-r0", "val-0"]
    assert sft(steps=(None, 1)) == ["s1-g0-r0", "s1-g0-r1", "s1-g1-r0"]
    tokens = export(log_dir, tmp_path / "y.parquet", "tokens", steps=(2, None), min_reward=0.5)
    assert ids(tokens) == ["s2-g0-r1"]
    # A filter changes which rows are written, not the advantages the step computed.
    assert tokens[0]["advantage"] == pytest.approx(0.7071, abs=1e-3)


def test_the_command_line(log_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.parquet"
    argv = [
        "export",
        "--data-dir",
        str(log_dir),
        "--format",
        "parquet",
        "--shape",
        "tokens",
        "--out",
        str(out),
    ]
    assert main([*argv, "--steps", "1:1", "--purpose", "train"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("exported 3 tokens rows (3 rollouts) from ") and str(out) in line
    assert len(rows(out)) == 3
    # One readable line for what cannot be exported, and no file left behind.
    for extra, says in [
        (["--steps", "3:1"], "--steps '3:1' is empty"),
        (["--steps", "x"], "--steps takes A:B"),
        (["--purpose", "validation"], "validation and evaluation rollouts are never trained"),
        (["--status", "failed"], "drop --status"),
    ]:
        assert main([*argv[:-1], str(tmp_path / "never.jsonl"), *extra]) == 2
        assert says in capsys.readouterr().err
    assert main(["export", "--data-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "n.jsonl")]) == 2
    assert "no run at" in capsys.readouterr().err
    assert not list(tmp_path.glob("never*")) and not list(tmp_path.glob("n.jsonl*"))


# --- memory ----------------------------------------------------------------------------------------


def traced_peak(data_dir: Path, out: Path) -> int:
    """Peak bytes Python allocated while exporting ``data_dir`` (a fresh trace)."""
    tracemalloc.start()
    try:
        export_dataset(data_dir, out, shape="tokens", fmt="jsonl")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_export_holds_what_is_in_flight_not_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's reader keeps the last calls it decoded, up to a fixed number of tokens (to
    # rebuild later calls' shared prompts); with that bound small, what remains is the export's.
    monkeypatch.setattr(reading, "_DECODED_TOKENS", 20_000)
    short, long = tmp_path / "short", tmp_path / "long"
    write_log(short, steps=40, prompt=64)
    write_log(long, steps=160, prompt=64)
    assert len(read_events_sync(long / "events.sqlite")) > 3_300
    small = traced_peak(short, tmp_path / "short.jsonl")
    large = traced_peak(long, tmp_path / "long.jsonl")
    # Four times the log, four times the rows written: about the same peak (an export that kept
    # the rollouts it wrote peaks at over three times as much here).
    assert large < 1.6 * small, (small, large)
