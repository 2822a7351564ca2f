"""The reward of the example question tasks: the last number in the agent's ``answer.txt``.

Owns how an answer is read and judged (``reward_function = "...answers:answer_reward"`` in a
config); the agents only write their final text to ``answer.txt`` in their working directory.
"""

from __future__ import annotations

import re
from pathlib import Path

from harness_adapters.base import Task

ANSWER_FILE = "answer.txt"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text``, or None."""
    found = NUMBER.findall(text)
    return float(found[-1]) if found else None


def answer_reward(task: Task, workdir: Path) -> float:
    """1.0 if the last number of ``answer.txt`` is the task's ``answer``, else 0.0 (also when
    the agent wrote no answer)."""
    try:
        text = (workdir / ANSWER_FILE).read_text()
    except OSError:
        return 0.0
    given = last_number(text)
    return 1.0 if given is not None and given == float(task.data["answer"]) else 0.0
