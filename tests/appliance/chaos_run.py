"""``lightning-appliance`` with faults injected at seeded points: the runner of the chaos test.

A test helper, not a test: ``python -m tests.appliance.chaos_run <plan.json> <cli args...>``
runs the real command line, with the engine and the trainer patched in this process to fail as
the ``FaultPlan`` says; the harness fails through the agent ``tests.appliance.chaos_agent``,
which reads the same plan (``$CHAOS_PLAN``). Every decision is a pure function of the plan's
seed and a stable key (a call's sampling seed, a rollout id, the trainer's call count), so a
failure reproduces from the seed, and the test can tell from a call's seed which fault the
engine gave it. Each fault that fires is appended to ``<out_dir>/faults.jsonl``.

The faults:

* engine (``TorchEngine.generate``, the first time a sampling seed is seen): raises, hangs
  until cancelled (a request the engine lost: only the drain's preemption or the client's
  cancellation ends it), or is slow. A preempted call resubmits its seed and is then served.
* trainer (``PolicyTrainer.step``, in its worker thread): raises (never three times in a row,
  which would stop the run with ``TrainingFailed``), hangs (sleeps past any stop), or is slow.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PLAN_ENV = "CHAOS_PLAN"


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultPlan:
    """What fails and how often, for one process of the chaos test."""

    seed: int
    #: Where ``faults.jsonl`` (faults that fired) and ``calls.jsonl`` (the agent's calls) go.
    out_dir: str
    #: Per call (engine), per step (trainer) and per rollout (agent): probability of each fault.
    engine: dict[str, float] = field(default_factory=dict)
    trainer: dict[str, float] = field(default_factory=dict)
    agent: dict[str, float] = field(default_factory=dict)
    #: Longest delay of a slow engine call and of a slow trainer step, in seconds.
    engine_slow_s: float = 3.0
    trainer_slow_s: float = 6.0
    #: How long a hung trainer step sleeps (longer than any iteration: only the stop ends it).
    trainer_hang_s: float = 3600.0

    @staticmethod
    def load(path: Path) -> FaultPlan:
        return FaultPlan(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    def _pick(self, odds: dict[str, float], key: str) -> tuple[str, random.Random]:
        """One fault kind (or "none") for ``key``, and a generator for its details."""
        rng = random.Random(f"{self.seed}:{key}")
        draw = rng.random()
        for kind, p in sorted(odds.items()):
            if draw < p:
                return kind, rng
            draw -= p
        return "none", rng

    def engine_fault(self, sampling_seed: int) -> tuple[str, float]:
        """The engine's fault for the call with this sampling seed: kind and delay (slow)."""
        kind, rng = self._pick(self.engine, f"engine:{sampling_seed}")
        return kind, rng.uniform(0.2, self.engine_slow_s) if kind == "slow" else 0.0

    def trainer_fault(self, call: int) -> tuple[str, float]:
        """The fault of the ``call``-th trainer step of this process (counted from 1)."""
        kind, rng = self._pick(self.trainer, f"trainer:{call}")
        return kind, rng.uniform(0.5, self.trainer_slow_s) if kind == "slow" else 0.0

    def agent_fault(self, rollout: str) -> tuple[str, random.Random]:
        """The agent's fault for ``rollout`` and the generator of its calls' details."""
        return self._pick(self.agent, f"agent:{rollout}")

    def record(self, what: str, kind: str, **details: Any) -> None:
        """Append one fault that fired (one ``write`` of one line: atomic for readers)."""
        append_line(Path(self.out_dir) / "faults.jsonl", {"what": what, "kind": kind, **details})


def append_line(path: Path, item: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(item) + "\n").encode())
    finally:
        os.close(fd)


def patch_engine(plan: FaultPlan) -> None:
    from appliance.engines.base import GenerateRequest, GenerateResult
    from appliance.engines.torch_engine import TorchEngine

    real_generate = TorchEngine.generate
    seen: set[int] = set()

    async def generate(self: TorchEngine, request: GenerateRequest) -> GenerateResult:
        seed = request.params.seed
        if seed is not None and seed not in seen:
            seen.add(seed)
            kind, delay = plan.engine_fault(seed)
            if kind != "none":
                plan.record("engine", kind, seed=seed, delay_s=delay)
            if kind == "raise":
                raise RuntimeError(f"chaos: the engine failed on the call with seed {seed}")
            if kind == "hang":
                await asyncio.Event().wait()  # lost: only a cancellation ends it
            if kind == "slow":
                await asyncio.sleep(delay)
        return await real_generate(self, request)

    TorchEngine.generate = generate  # type: ignore[method-assign]


def patch_trainer(plan: FaultPlan) -> None:
    from trainer.items import StepOutput, TrainItem
    from trainer.policy import PolicyTrainer

    real_step = PolicyTrainer.step
    calls = 0
    raised_in_a_row = 0

    def step(self: PolicyTrainer, items: Sequence[TrainItem]) -> StepOutput:
        nonlocal calls, raised_in_a_row
        calls += 1
        kind, delay = plan.trainer_fault(calls)
        if kind == "raise" and raised_in_a_row >= 2:
            kind = "none"  # a third failure in a row would end the run (TrainingFailed)
        raised_in_a_row = raised_in_a_row + 1 if kind == "raise" else 0
        if kind != "none":
            plan.record("trainer", kind, call=calls, delay_s=delay)
        if kind == "raise":
            raise RuntimeError(f"chaos: trainer step call {calls} failed")
        if kind == "hang":
            time.sleep(plan.trainer_hang_s)
        if kind == "slow":
            time.sleep(delay)
        return real_step(self, items)

    PolicyTrainer.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    import torch

    from appliance.cli import main

    torch.set_num_threads(1)
    plan_path, *args = sys.argv[1:]
    os.environ[PLAN_ENV] = plan_path
    plan = FaultPlan.load(Path(plan_path))
    patch_engine(plan)
    patch_trainer(plan)
    sys.exit(main(args))
