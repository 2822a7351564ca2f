"""``lightning-appliance`` with a trainer whose Nth step blocks until the process is killed.

A test helper, not a test: ``python -m tests.appliance.slow_train <marker> <n> <cli args...>``
runs the real command line, but the ``n``-th call of ``PolicyTrainer.step`` writes ``marker``
and then sleeps, so a test can SIGKILL the appliance while a step is inside the trainer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from appliance.cli import main
from trainer.items import StepOutput, TrainItem
from trainer.policy import PolicyTrainer


def block_step(marker: Path, block_at: int) -> None:
    """Make the ``block_at``-th trainer step announce itself in ``marker`` and never return."""
    real_step = PolicyTrainer.step
    calls = 0

    def step(self: PolicyTrainer, items: Sequence[TrainItem]) -> StepOutput:
        nonlocal calls
        calls += 1
        if calls == block_at:
            marker.write_text(f"{calls}\n")
            time.sleep(3600)
        return real_step(self, items)

    PolicyTrainer.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    torch.set_num_threads(1)
    marker, block_at, *args = sys.argv[1:]
    block_step(Path(marker), int(block_at))
    sys.exit(main(args))
