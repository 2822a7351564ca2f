"""Task sets: where the tasks of a run come from, and in which order.

Owns loading a task set from disk (JSONL, Parquet, a directory of such files, or a Hugging Face
``datasets`` directory written by ``save_to_disk``), its train/validation splits, and the task
stream a run draws from. It knows nothing about adapters: a task is an id and a JSON object.

* Ids come from ``id_field`` (default: the first of ``id``, ``instance_id``, ``task_id`` that
  the records have, else ``<name>-<row>``); duplicates are an error.
* Splits: named by the source (a ``DatasetDict``, or files named ``train*``/``validation*``/
  ``test*``), else by a ``split`` field in each record, else drawn by a seeded hash of the task
  id (``validation_fraction``), which keeps a task in its split when others are added.
* Relative paths in ``path_fields`` (``repo``, ``repo_dir``, ``repos_dir``) are made absolute
  against the task set file's directory, so a shipped task set works from any working
  directory (a SWE-bench instance's ``repo``, "owner/name", is left as it is).
* The stream is deterministic and resumable: ``stream(seed=s, start=i)`` yields exactly what
  the first stream yielded from position ``i`` on (each epoch in a seeded order). The
  controller draws ONE task per group and runs it ``group_size`` times (GRPO needs several
  rollouts of the same task), so position ``i`` is group ``i`` and a restarted run continues
  with ``start = groups so far``, as it does with ``arithmetic_tasks``.

Also owns the built-in arithmetic task set (``arithmetic_task(s)``).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError
from harness_adapters.base import Task

ID_FIELDS = ("id", "instance_id", "task_id")
PATH_FIELDS = ("repo", "repo_dir", "repos_dir")
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
}
Record = dict[str, Any]


def arithmetic_task(index: int, *, seed: int = 0) -> Task:
    """``What is a + b?`` with single digits (the task a small model can learn on CPU)."""
    rng = random.Random(f"{seed}:{index}")
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return Task(
        id=f"add-{seed}-{index}", data={"a": a, "b": b, "answer": a + b, "question": f"What is {a} + {b}?"}
    )


def arithmetic_tasks(*, seed: int = 0, start: int = 0) -> Iterator[Task]:
    index = start
    while True:
        yield arithmetic_task(index, seed=seed)
        index += 1


def _jsonable(record: Mapping[str, Any]) -> Record:
    """A plain JSON object (what events store): dates and other scalars become strings."""
    out: Record = json.loads(json.dumps(dict(record), default=str))
    return out


def _split_name(value: Any) -> str:
    text = str(value).strip().lower()
    return SPLIT_ALIASES.get(text, text)


def _hash_fraction(seed: int, task_id: str) -> float:
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class TaskSet:
    name: str
    tasks: tuple[Task, ...]
    _orders: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for task in self.tasks:
            if task.id in seen:
                raise ConfigError(f"task set {self.name!r}: duplicate task id {task.id!r}")
            seen.add(task.id)

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __getitem__(self, index: int) -> Task:
        return self.tasks[index]

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        *,
        name: str = "tasks",
        id_field: str | None = None,
        base_dir: Path | None = None,
        path_fields: Sequence[str] = PATH_FIELDS,
    ) -> TaskSet:
        rows = [_jsonable(r) for r in records]
        key = id_field or next((f for f in ID_FIELDS if rows and all(f in r for r in rows)), None)
        if id_field is not None and any(id_field not in r for r in rows):
            raise ConfigError(f"task set {name!r}: some records have no {id_field!r} field")
        tasks = []
        for row, data in enumerate(rows):
            if base_dir is not None:
                for name_ in path_fields:
                    value = data.get(name_)
                    if name_ == "repo" and "base_commit" in data:
                        continue  # a SWE-bench instance's repo is "owner/name", not a path
                    if isinstance(value, str) and value and not Path(value).is_absolute():
                        data[name_] = str((base_dir / value).resolve())
            task_id = str(data[key]) if key is not None else f"{name}-{row}"
            tasks.append(Task(id=task_id, data=data))
        return cls(name, tuple(tasks))

    @classmethod
    def load(
        cls,
        source: str | Path,
        *,
        split: str | None = "train",
        id_field: str | None = None,
        split_field: str = "split",
        validation_fraction: float = 0.0,
        seed: int = 0,
    ) -> TaskSet:
        """One split of a task set on disk (``split=None``: all of it)."""
        sets = load_splits(
            source,
            id_field=id_field,
            split_field=split_field,
            validation_fraction=validation_fraction,
            seed=seed,
        )
        if split is None:
            everything = [task for s in sets.values() for task in s.tasks]
            return cls(Path(source).stem, tuple(everything))
        wanted = _split_name(split)
        if wanted not in sets:
            raise ConfigError(f"task set {str(source)!r} has no split {split!r}; it has {sorted(sets)}")
        return sets[wanted]

    # --- the stream ------------------------------------------------------------------------------

    def _order(self, epoch: int, seed: int) -> list[int]:
        key = (epoch, seed)
        if key not in self._orders:
            order = list(range(len(self.tasks)))
            random.Random(f"{self.name}:{seed}:{epoch}").shuffle(order)
            self._orders.clear()
            self._orders[key] = order
        return self._orders[key]

    def task_at(self, position: int, *, seed: int = 0, shuffle: bool = True) -> Task:
        """The task at ``position`` of the endless stream (epoch after epoch)."""
        if not self.tasks:
            raise ConfigError(f"task set {self.name!r} is empty")
        epoch, offset = divmod(position, len(self.tasks))
        index = self._order(epoch, seed)[offset] if shuffle else offset
        return self.tasks[index]

    def stream(self, *, seed: int = 0, start: int = 0, shuffle: bool = True) -> Iterator[Task]:
        """Tasks from position ``start`` on, endlessly; the same for the same seed."""
        position = start
        while True:
            yield self.task_at(position, seed=seed, shuffle=shuffle)
            position += 1


# --- readers ---------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[Record]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number}: a task must be a JSON object")
        records.append(record)
    return records


def read_parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError("reading Parquet task sets needs pyarrow (pip install pyarrow)") from None
    rows: list[Record] = pq.read_table(path).to_pylist()
    return rows


def read_hf_dir(path: Path) -> dict[str | None, list[Record]]:
    """A ``datasets`` ``save_to_disk`` directory: one ``Dataset``, or a ``DatasetDict`` of splits."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("reading a datasets directory needs the datasets package") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        return {name: list(loaded[name]) for name in loaded}
    return {None: list(loaded)}


def _read_file(path: Path) -> list[Record]:
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    if path.suffix == ".parquet":
        return read_parquet(path)
    raise ConfigError(f"{str(path)!r}: task set files must be .jsonl or .parquet")


def _read_source(path: Path) -> dict[str | None, list[Record]]:
    """Records by split name as the source names them (None: not named by the source)."""
    if path.is_file():
        return {None: _read_file(path)}
    if not path.is_dir():
        raise ConfigError(f"task set {str(path)!r} does not exist")
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return read_hf_dir(path)
    folder = path / "data" if (path / "data").is_dir() else path
    files = sorted(p for p in folder.iterdir() if p.suffix in (".jsonl", ".parquet"))
    if not files:
        raise ConfigError(f"task set directory {str(path)!r} holds no .jsonl or .parquet files")
    prefixes = [re.split(r"[-_.]", p.name, maxsplit=1)[0].lower() for p in files]
    named = all(prefix in SPLIT_ALIASES for prefix in prefixes)
    out: dict[str | None, list[Record]] = {}
    for prefix, file in zip(prefixes, files, strict=True):
        out.setdefault(SPLIT_ALIASES[prefix] if named else None, []).extend(_read_file(file))
    return out


def load_splits(
    source: str | Path,
    *,
    id_field: str | None = None,
    split_field: str = "split",
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> dict[str, TaskSet]:
    """Every split of a task set on disk, by name (``train``, ``validation``, ``test``, ...)."""
    path = Path(source).expanduser()
    if not 0.0 <= validation_fraction < 1.0:
        raise ConfigError(f"validation_fraction must be in [0, 1); got {validation_fraction}")
    base_dir = path.parent if path.is_file() else path
    by_source = _read_source(path)
    sets: dict[str, list[Task]] = {}
    for named, records in by_source.items():
        whole = TaskSet.from_records(records, name=path.stem, id_field=id_field, base_dir=base_dir)
        for task in whole.tasks:
            if named is not None:
                split = named
            elif split_field in task.data:
                split = _split_name(task.data[split_field])
            elif _hash_fraction(seed, task.id) < validation_fraction:
                split = "validation"
            else:
                split = "train"
            sets.setdefault(split, []).append(task)
    return {name: TaskSet(f"{path.stem}/{name}", tuple(tasks)) for name, tasks in sets.items()}
