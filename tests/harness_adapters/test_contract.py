"""One contract, run against every local adapter through a real appliance.

For ``command``, ``python`` (in this process, and in a worker process) and ``mini-swe-agent``:

1. a rollout runs through the proxy; its calls and its reward are recorded, and the calls
   merge into token-exact samples;
2. a rollout that outlives its timeout is recorded as failed, and every process it started
   is gone, including one that left the process group (``setsid``);
3. a crashing agent is recorded as failed with the tail of its stderr (in-process: the
   traceback);
4. after 2 and 3 the appliance still runs the next rollout to its end.

The agents are real programs that know nothing of the appliance (``agents/chat_agent.py``
reads ``OPENAI_BASE_URL``; mini-swe-agent is the real ``mini`` CLI). The tiny model answers
the ``command`` and ``python`` agents; mini-swe-agent gets a scripted engine (tool calls that
fix a shipped task, or that hang), or one that raises (the proxy answers 500, mini crashes).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from harness_adapters.base import HarnessAdapter, Task
from harness_adapters.command import CommandAdapter
from harness_adapters.mini_swe import MiniSweAgentAdapter
from harness_adapters.python import PythonAdapter
from harness_adapters.tasks import TaskSet
from store.events import LLMCallCompleted, RewardReported
from store.projections import RolloutView
from tests.harness_adapters.support import (
    PYTHON_BUGS,
    ScriptedEngine,
    agent_cmd,
    alive,
    tool_call,
    wait_ended,
)
from tests.support import make_config
from trainer.samples import build_samples

MINI = Path(sys.executable).parent / "mini"
PY_AGENT = "tests.harness_adapters.agents.py_agents:agent"
FIZZBUZZ = next(t for t in TaskSet.load(PYTHON_BUGS) if "fizzbuzz" in t.id)
#: What mini-swe-agent is told to do to solve the fizzbuzz task, one tool call per model call.
MINI_SOLUTION = [
    tool_call("cat fizzbuzz.py", "Let me read the code."),
    tool_call("sed -i 's/range(1, n)/range(1, n + 1)/' fizzbuzz.py", "The range stops one number early."),
    tool_call("python -m pytest -q -p no:cacheprovider test_fizzbuzz.py", "Now the tests."),
    tool_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "Done."),
]
Script = list[str | Exception]


@dataclass(frozen=True)
class Case:
    name: str
    adapter: Callable[[Path], HarnessAdapter]
    #: The task of a rollout behaving as told ("ok", "hang", "crash"), given the pid directory.
    task: Callable[[str, Path], Task]
    #: The engine's answers for that behaviour (None: the tiny model answers).
    script: Callable[[str, Path], Script] | None
    #: The reward an "ok" rollout gets, and who records it ("http" or "adapter").
    reward: float
    reward_source: str
    #: The rollout timeout of the hang test (mini-swe-agent takes seconds to start).
    hang_timeout_s: float
    #: Whether the agent's stderr lands in ``agent.stderr`` of the rollout directory.
    stderr_file: bool = True


def plain_task(reward: float) -> Callable[[str, Path], Task]:
    def make(behavior: str, pid_dir: Path) -> Task:
        data = {"behavior": behavior, "pid_dir": str(pid_dir), "reward": reward, "question": "What is 2 + 2?"}
        return Task(f"contract-{behavior}", data)

    return make


def mini_script(behavior: str, pid_dir: Path) -> Script:
    if behavior == "ok":
        return list(MINI_SOLUTION)
    if behavior == "hang":
        # mini-swe-agent runs each command in a session of its own: out of its process group.
        # (The pids go to its working directory: a long path would not fit in max_tokens.)
        return [tool_call("sleep 300 & echo $$ $! > mini.pids; sleep 301", "Waiting.")]
    return [RuntimeError("boom-crash-marker")]


CASES = [
    Case(
        "command",
        lambda root: CommandAdapter(command=agent_cmd(), workdir_root=root, kill_grace_s=1.0),
        plain_task(0.5),
        None,
        reward=0.5,
        reward_source="http",
        hang_timeout_s=4.0,
    ),
    Case(
        "python",
        lambda root: PythonAdapter(PY_AGENT),
        plain_task(0.25),
        None,
        reward=0.25,
        reward_source="adapter",
        hang_timeout_s=4.0,
        stderr_file=False,
    ),
    Case(
        "python-process",
        lambda root: PythonAdapter(PY_AGENT, isolation="process", workdir_root=root, kill_grace_s=1.0),
        plain_task(0.75),
        None,
        reward=0.75,
        reward_source="adapter",
        hang_timeout_s=8.0,
    ),
    Case(
        "mini-swe-agent",
        lambda root: MiniSweAgentAdapter(workdir_root=root, kill_grace_s=1.0, step_limit=6),
        lambda behavior, pid_dir: FIZZBUZZ,
        mini_script,
        reward=1.0,
        reward_source="adapter",
        hang_timeout_s=45.0,
    ),
]


@pytest.fixture(params=CASES, ids=[case.name for case in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    chosen: Case = request.param
    if chosen.name == "mini-swe-agent" and not MINI.is_file():
        pytest.skip(f"mini-swe-agent is not installed ({MINI})")
    return chosen


@dataclass
class Harness:
    """An appliance running ``case``'s adapter, and how to start one rollout on it."""

    app: Appliance
    case: Case
    pid_dir: Path
    rollouts_dir: Path
    tokenizer: Tokenizer
    monkeypatch: pytest.MonkeyPatch
    started: int = 0

    async def rollout(self, behavior: str, *, timeout_s: float = 120.0) -> RolloutView:
        """Start one rollout behaving as told and wait until it has ended."""
        if self.case.script is not None:
            engine = ScriptedEngine(self.tokenizer, self.case.script(behavior, self.pid_dir))
            self.monkeypatch.setattr(self.app.engine, "generate", engine.generate)
        # The controller draws from its task stream; the test decides what comes next.
        self.app.controller._tasks = iter([self.case.task(behavior, self.pid_dir)])
        self.app.controller._timeout_s = timeout_s
        group = await self.app.controller.start_group(1)
        self.started += 1
        await wait_ended(self.app, self.started, timeout_s=timeout_s + 60)
        return self.app.live.state.rollouts[f"{group}-r0"]

    async def calls(self, rollout: str) -> list[LLMCallCompleted]:
        events = await self.app.store.read(rollout=rollout)
        return [s.event for s in events if isinstance(s.event, LLMCallCompleted)]

    def rollout_dir(self, rollout: str) -> Path:
        (found,) = self.rollouts_dir.glob(f"{rollout}-*")
        return found


@asynccontextmanager
async def harness(
    case: Case, tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Harness]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # 128 tokens leave room for a scripted tool call.
    config = make_config(tmp_path, model_dir, max_tokens=128 if case.script else 8)
    async with Appliance(config, adapter=case.adapter(tmp_path / "rollouts")) as app:
        yield Harness(
            app, case, pid_dir, tmp_path / "rollouts", Tokenizer.from_model_dir(model_dir), monkeypatch
        )


async def check_keeps_going(h: Harness) -> None:
    view = await h.rollout("ok")
    assert view.status == "finished", view.error
    assert view.reward == h.case.reward


async def test_a_rollout_records_its_calls_and_reward(
    case: Case, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(case, tmp_path, tiny_model_dir, monkeypatch) as h:
        view = await h.rollout("ok")
        assert view.status == "finished", view.error
        assert view.reward == case.reward
        rewards = [
            s.event
            for s in await h.app.store.read(rollout=view.rollout)
            if isinstance(s.event, RewardReported)
        ]
        assert [(r.reward, r.source) for r in rewards] == [(case.reward, case.reward_source)]
        calls = await h.calls(view.rollout)
        assert calls and len(calls) == len(view.calls)
        assert len(calls) == (len(MINI_SOLUTION) if case.script else 1)
        # Every sampled token is trained on exactly once, in call order.
        samples = build_samples(calls)
        sampled = [t for s in samples for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        assert sampled == [t for call in calls for t in call.response_ids]


async def test_a_timeout_kills_the_whole_process_tree(
    case: Case, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(case, tmp_path, tiny_model_dir, monkeypatch) as h:
        view = await h.rollout("hang", timeout_s=case.hang_timeout_s)
        assert view.status == "failed"
        assert view.error == f"timed out after {case.hang_timeout_s:g} s (rollout_timeout_s)"
        pid_files = [*h.pid_dir.glob("*.pids"), *h.rollouts_dir.glob("*/work/*.pids")]
        assert pid_files, "the agent never got to start its children: raise hang_timeout_s"
        pids = [int(pid) for path in pid_files for pid in path.read_text().split()]
        assert len(pids) >= 2
        assert [pid for pid in pids if alive(pid)] == [], "a process of the timed-out rollout survived"
        await check_keeps_going(h)


async def test_a_crash_is_recorded_with_its_stderr_tail(
    case: Case, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(case, tmp_path, tiny_model_dir, monkeypatch) as h:
        view = await h.rollout("crash")
        assert view.status == "failed"
        error = view.error
        if case.name == "mini-swe-agent":
            # mini crashes because the proxy refused its calls: the refusal is the reason's head.
            head, _, error = error.partition("\n")
            assert head.startswith("every model call was refused: "), head
        assert error.startswith("AgentFailed: ")
        if case.stderr_file:
            assert "exit code" in error
            stderr = (h.rollout_dir(view.rollout) / "agent.stderr").read_text().rstrip()
            assert stderr, "the agent wrote nothing to stderr"
            assert error.endswith(stderr.splitlines()[-1].rstrip())
        else:
            assert error.startswith("AgentFailed: RuntimeError: boom-crash-marker\nTraceback")
        if case.name != "mini-swe-agent":
            assert "boom-crash-marker" in error
        await check_keeps_going(h)
