"""mini-swe-agent on a shipped coding task: solved by a scripted model, rewarded by the task's tests.

The real ``mini`` CLI runs in a fresh copy of the task's repository, against a real appliance.
A scripted engine answers with the tool calls that fix the bug; the task's tests then pass
(reward 1.0, recorded by the adapter), and mini-swe-agent's calls, which re-send the whole
history with the earlier tool calls, merge into one token-exact sample. On the tiny random
model the same task ends unsolved: a finished rollout with reward 0.0, not a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from harness_adapters.mini_swe import CONFIG, MiniSweAgentAdapter
from harness_adapters.tasks import TaskSet
from harness_adapters.workdir import RolloutDir
from store.events import LLMCallCompleted, RewardReported
from tests.harness_adapters.support import PYTHON_BUGS, ScriptedEngine, client_config, wait_ended
from tests.harness_adapters.test_contract import MINI_SOLUTION
from tests.support import make_config
from trainer.samples import build_samples

MINI = Path(sys.executable).parent / "mini"


def test_command_line_and_environment() -> None:
    adapter = MiniSweAgentAdapter(
        step_limit=7, command_timeout_s=9, overrides={"model.model_kwargs": {"t": 1}}
    )
    argv = adapter.command.argv
    assert argv[:5] == [str(MINI), "-m", "openai/{model}", "-t", "{problem_statement}"]
    settings = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-c"]
    assert settings == [
        "mini.yaml",
        str(CONFIG),
        "agent.step_limit=7",
        "environment.timeout=9",
        'model.model_kwargs={{"t": 1}}',  # braces escaped: a literal, not a placeholder
    ]
    task = TaskSet.load(PYTHON_BUGS)[0]
    rendered = adapter.command.agent_argv(task, client_config(), RolloutDir(Path("/r")))
    assert rendered[rendered.index("-t") + 1] == task.data["problem_statement"]
    assert rendered[-1] == 'model.model_kwargs={"t": 1}'
    assert adapter.command.config.env["MSWEA_GLOBAL_CONFIG_DIR"] == "{rollout_dir}/mswea"


@pytest.mark.skipif(not MINI.is_file(), reason=f"mini-swe-agent is not installed ({MINI})")
async def test_mini_swe_agent_solves_a_shipped_task(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks = TaskSet.load(PYTHON_BUGS)
    fizzbuzz = next(t for t in tasks if "fizzbuzz" in t.id)
    adapter = MiniSweAgentAdapter(workdir_root=tmp_path / "rollouts", keep_workdirs="always", step_limit=6)
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=128), adapter=adapter) as app:
        engine = ScriptedEngine(Tokenizer.from_model_dir(tiny_model_dir), list(MINI_SOLUTION))
        real_generate = app.engine.generate
        monkeypatch.setattr(app.engine, "generate", engine.generate)
        app.controller._tasks = iter([fizzbuzz, fizzbuzz])
        solved = f"{await app.controller.start_group(1)}-r0"
        await wait_ended(app, 1, timeout_s=240)
        monkeypatch.setattr(app.engine, "generate", real_generate)
        unsolved = f"{await app.controller.start_group(1)}-r0"
        await wait_ended(app, 2, timeout_s=240)

        state = app.live.state.rollouts
        assert state[solved].status == "finished", state[solved].error
        assert state[solved].reward == 1.0
        assert state[unsolved].status == "finished", state[unsolved].error
        assert state[unsolved].reward == 0.0
        events = [s.event for s in await app.store.read(rollout=solved)]

    rewards = [e for e in events if isinstance(e, RewardReported)]
    assert [(r.reward, r.source) for r in rewards] == [(1.0, "adapter")]
    (rdir,) = (tmp_path / "rollouts").glob(f"{solved}-*")
    assert "range(1, n + 1)" in (rdir / "work" / "fizzbuzz.py").read_text()
    assert "3 passed" in (rdir / "tests.stdout").read_text()
    original = Path(str(fizzbuzz.data["repo"])) / "fizzbuzz.py"
    assert "range(1, n)" in original.read_text(), "the shipped repo is never touched"

    # The calls merge into ONE token-exact sample: each prompt extends the previous prompt and
    # response, and the trained tokens are exactly the sampled ones.
    calls = [e for e in events if isinstance(e, LLMCallCompleted)]
    assert len(calls) == len(MINI_SOLUTION)
    assert all(c.unmatched_assistant_turns == 0 for c in calls)
    (sample,) = build_samples(calls)
    assert sample.tokens[: len(calls[0].prompt_ids)] == calls[0].prompt_ids
    sampled = tuple(t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m)
    assert sampled == tuple(t for c in calls for t in c.response_ids)
    assert {lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m} == {
        ScriptedEngine.LOGPROB
    }
