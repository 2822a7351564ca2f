"""Task sets: JSONL, Parquet and datasets directories, splits, and a resumable stream."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from contracts.errors import ConfigError
from harness_adapters.base import Task
from harness_adapters.tasks import TaskSet, load_splits

RECORDS: list[dict[str, Any]] = [
    {"instance_id": f"t{i}", "problem_statement": f"fix bug {i}", "n": i, "repo": "repos/r"}
    for i in range(10)
]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_ids_and_relative_paths(tmp_path: Path) -> None:
    tasks = TaskSet.load(write_jsonl(tmp_path / "set.jsonl", RECORDS))
    assert [t.id for t in tasks] == [f"t{i}" for i in range(10)]
    assert tasks[3].data["n"] == 3
    assert tasks[0].data["repo"] == str(tmp_path / "repos" / "r"), "paths resolve against the file"
    ids = TaskSet.from_records([{"q": 1}, {"q": 2}], name="plain")
    assert [t.id for t in ids] == ["plain-0", "plain-1"]


def test_bad_records_are_readable_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not JSON"):
        TaskSet.load(bad)
    with pytest.raises(ConfigError, match="duplicate task id 'a'"):
        TaskSet.from_records([{"id": "a"}, {"id": "a"}])
    with pytest.raises(ConfigError, match="does not exist"):
        TaskSet.load(tmp_path / "nowhere.jsonl")
    with pytest.raises(ConfigError, match="no split 'test'"):
        TaskSet.load(write_jsonl(tmp_path / "ok.jsonl", RECORDS), split="test")


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "set.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    assert TaskSet.load(path).tasks == TaskSet.load(write_jsonl(tmp_path / "set.jsonl", RECORDS)).tasks


def test_datasets_directories(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "one"))
    assert len(TaskSet.load(tmp_path / "one")) == 10
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(RECORDS[:7]),
            "validation": datasets.Dataset.from_list(RECORDS[7:]),
        }
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert [t.id for t in TaskSet.load(tmp_path / "dict", split="validation")] == ["t7", "t8", "t9"]
    assert len(TaskSet.load(tmp_path / "dict", split=None)) == 10


def test_split_files_in_a_directory(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train-00000-of-00001.jsonl", RECORDS[:8])
    write_jsonl(tmp_path / "data" / "dev.jsonl", RECORDS[8:])
    assert sorted(load_splits(tmp_path)) == ["train", "validation"]
    assert [t.id for t in TaskSet.load(tmp_path, split="val")] == ["t8", "t9"]


def test_split_by_field_and_by_seeded_fraction(tmp_path: Path) -> None:
    labelled = [r | {"split": "valid" if r["n"] % 5 == 0 else "train"} for r in RECORDS]
    path = write_jsonl(tmp_path / "labelled.jsonl", labelled)
    assert [t.id for t in TaskSet.load(path, split="validation")] == ["t0", "t5"]

    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": f"p{i}"} for i in range(400)])
    first = load_splits(plain, validation_fraction=0.25, seed=1)
    assert abs(len(first["validation"]) - 100) < 30
    assert load_splits(plain, validation_fraction=0.25, seed=1) == first, "the same seed, the same split"
    # A task keeps its split when others are added: the draw depends on its id only.
    grown = write_jsonl(tmp_path / "grown.jsonl", [{"id": f"p{i}"} for i in range(500)])
    grown_validation = {t.id for t in load_splits(grown, validation_fraction=0.25, seed=1)["validation"]}
    assert {t.id for t in first["validation"]} <= grown_validation


def test_stream_is_deterministic_resumable_and_covers_each_epoch() -> None:
    tasks = TaskSet.from_records(RECORDS, name="s")
    stream = list(islice(tasks.stream(seed=7), 30))
    assert all(isinstance(t, Task) for t in stream)
    for epoch in range(3):
        assert sorted(t.id for t in stream[epoch * 10 : (epoch + 1) * 10]) == sorted(t.id for t in tasks)
    assert stream[:10] != stream[10:20], "each epoch has its own order"
    assert list(islice(tasks.stream(seed=7, start=13), 17)) == stream[13:], "a restart continues the stream"
    assert list(islice(tasks.stream(seed=8), 10)) != stream[:10]
    assert list(islice(tasks.stream(shuffle=False), 12)) == [*tasks.tasks, *tasks.tasks[:2]]
    with pytest.raises(ConfigError, match="empty"):
        next(TaskSet.from_records([], name="none").stream())
