"""Task sets: where the tasks of a run come from.

Owns the built-in example task set and the group bookkeeping a GRPO run needs: the i-th task
handed out is always the same for a given seed, so a restarted run continues the same stream.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from harness_adapters.base import Task


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
