"""The real ``mini`` CLI (mini-swe-agent, through litellm's openai route) run against a rollout.

mini-swe-agent is started headless as a subprocess, pointed at the rollout through environment
variables only, in a temporary working directory, with the package's own ``mini.yaml`` under a
small override (``fixtures/mini_swe_agent.yaml``: a short task prompt, at most three calls).
It speaks Chat Completions with one ``bash`` tool and re-sends its whole history each call.

Two runs:

* On the tiny random model, whose answers never hold a tool call. mini-swe-agent then drops the
  assistant turn (its ``FormatError`` path keeps only the error message it adds as a user turn),
  so no call's prompt holds an earlier response: one sample per call is the right merge, and
  what must hold is that the history it re-sends is rendered to the very same tokens.
* On a scripted engine that answers with real tool calls: mini-swe-agent runs them, sends the
  assistant turns back, and the proxy must splice them so the whole episode is ONE sample whose
  trained tokens are exactly every call's response.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance.app import Appliance
from appliance.chat.render import GENERATION_PROMPT
from appliance.chat.tokenizer import Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.rollouts.registry import ActiveRollout
from store.events import LLMCallCompleted
from tests.support import make_config
from trainer.samples import Sample, build_samples

MINI = Path(sys.executable).parent / "mini"
CONFIG = Path(__file__).parent / "fixtures" / "mini_swe_agent.yaml"
TASK = "Add up the numbers in numbers.txt and write their sum into sum.txt"
#: The task text as mini-swe-agent's instance template puts it in the first user message.
TASK_PROMPT = f"Please solve this issue: {TASK}"
RUN_TIMEOUT_S = 90.0

pytestmark = pytest.mark.skipif(not MINI.is_file(), reason=f"mini-swe-agent is not installed ({MINI})")


@dataclass(frozen=True, slots=True)
class MiniRun:
    returncode: int
    output: str
    trajectory: dict[str, Any]

    @property
    def exit_status(self) -> str:
        return str(self.trajectory["info"]["exit_status"])


class ScriptedEngine:
    """Stands in for ``TorchEngine.generate``: answers each call with the next scripted text.

    The text is tokenized with the model's tokenizer and ends with ``<|im_end|>``, as a model's
    answer does; every token gets log-probability ``LOGPROB`` and goes through ``on_token``.
    """

    LOGPROB = -0.25

    def __init__(self, tokenizer: Tokenizer, answers: list[str]) -> None:
        self._tokenizer = tokenizer
        self._answers = list(answers)
        self.prompts: list[tuple[int, ...]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not self._answers:
            raise AssertionError("the harness made more calls than the script has answers")
        self.prompts.append(tuple(request.prompt_ids))
        ids = [*self._tokenizer.encode(self._answers.pop(0)), self._tokenizer.im_end_id]
        finish = "stop"
        if len(ids) > request.params.max_tokens:
            ids, finish = ids[: request.params.max_tokens], "length"
        for token in ids:
            if request.on_token is not None:
                request.on_token(token, self.LOGPROB)
        return GenerateResult(
            token_ids=tuple(ids), logprobs=(self.LOGPROB,) * len(ids), finish_reason=finish, policy_version=0
        )


def tool_call(command: str, thought: str) -> str:
    """A hermes-style tool call of mini-swe-agent's ``bash`` tool, as the chat template shows it."""
    payload = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"{thought}\n<tool_call>\n{payload}\n</tool_call>"


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    # 96 tokens leave room for a scripted tool call; the random model gets cut off either way.
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=96)) as appliance:
        yield appliance


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The task's working directory: three numbers to add up."""
    directory = tmp_path / "work"
    directory.mkdir()
    (directory / "numbers.txt").write_text("1\n2\n3\n")
    return directory


def rollout(app: Appliance, name: str = "mini") -> ActiveRollout:
    return app.registry.register(name, task_id="sum", group="g", task={"task": TASK})


def mini_env(app: Appliance, active: ActiveRollout, tmp_path: Path) -> dict[str, str]:
    """The harness's environment: the rollout's URL and token, nothing read from the user's home."""
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENAI_", "ANTHROPIC_", "LITELLM_", "MSWEA_"))
    }
    env.update(
        OPENAI_BASE_URL=url,
        OPENAI_API_BASE=url,
        OPENAI_API_KEY=active.token,
        NO_PROXY="127.0.0.1,localhost",
        # Headless: no first-run wizard, no cost lookups for an unknown model, no network.
        MSWEA_CONFIGURED="true",
        MSWEA_COST_TRACKING="ignore_errors",
        MSWEA_GLOBAL_CONFIG_DIR=str(tmp_path / "mswea-config"),
        MSWEA_SILENT_STARTUP="1",
        # A proxy error fails the run at once instead of being retried with back-off for minutes.
        MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT="1",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    return env


async def run_mini(app: Appliance, active: ActiveRollout, workdir: Path, tmp_path: Path) -> MiniRun:
    """Run ``mini`` to its end in the background of this event loop (the appliance serves it)."""
    trajectory = tmp_path / "traj.json"
    process = await asyncio.create_subprocess_exec(
        str(MINI),
        "-m",
        f"openai/{app.model_name}",
        "-t",
        TASK,
        "-y",
        "--exit-immediately",
        "-o",
        str(trajectory),
        "-c",
        "mini.yaml",
        "-c",
        str(CONFIG),
        cwd=workdir,
        env=mini_env(app, active, tmp_path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        raw, _ = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"mini-swe-agent did not finish within {RUN_TIMEOUT_S:g} s")
    output = raw.decode(errors="replace")
    assert trajectory.is_file(), f"mini-swe-agent wrote no trajectory (exit {process.returncode}):\n{output}"
    return MiniRun(process.returncode or 0, output, json.loads(trajectory.read_text()))


async def calls_of(app: Appliance, rollout_id: str) -> list[LLMCallCompleted]:
    return [
        s.event
        for s in await app.store.read(types={"LLMCallCompleted"})
        if isinstance(s.event, LLMCallCompleted) and s.event.rollout == rollout_id
    ]


def sampled_tokens(samples: list[Sample]) -> tuple[int, ...]:
    return tuple(
        t for sample in samples for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m == 1
    )


def check_harness_calls(run: MiniRun, calls: list[LLMCallCompleted], tokenizer: Tokenizer) -> None:
    """What holds for every mini-swe-agent run, whatever the model answered."""
    assert run.trajectory["info"]["model_stats"]["api_calls"] == len(calls), run.output
    for call in calls:
        assert call.surface == "openai.chat"
        assert "openai" in call.user_agent.lower() or "litellm" in call.user_agent.lower(), call.user_agent
        assert [t["function"]["name"] for t in call.request["tools"]] == ["bash"]
        assert TASK_PROMPT in call.request["messages"][1]["content"]
        assert TASK_PROMPT in tokenizer.decode(call.prompt_ids)
        # Every assistant turn mini-swe-agent sends back is one the proxy sampled for it.
        assert call.unmatched_assistant_turns == 0, call.request["messages"]
    # Every response token is trained on exactly once, in call order, whatever the merge.
    samples = build_samples(calls)
    assert sampled_tokens(samples) == tuple(t for call in calls for t in call.response_ids)
    assert [c for s in samples for c in s.call_ids] == [c.call_id for c in calls]


async def test_mini_swe_agent_on_the_random_model(
    app: Appliance, tokenizer: Tokenizer, workdir: Path, tmp_path: Path
) -> None:
    active = rollout(app)
    run = await run_mini(app, active, workdir, tmp_path)
    calls = await calls_of(app, active.rollout)

    # The run ends on its own limits: three unusable answers, or three steps.
    assert run.exit_status in ("RepeatedFormatError", "LimitsExceeded"), run.output
    assert 2 <= len(calls) <= 3, run.output
    check_harness_calls(run, calls, tokenizer)

    # mini-swe-agent re-sends its history verbatim and the proxy renders it to the same tokens:
    # each prompt, less the generation prompt, starts the next one.
    generation_prompt = tuple(tokenizer.encode(GENERATION_PROMPT))
    for before, after in itertools.pairwise(calls):
        assert before.prompt_ids[-len(generation_prompt) :] == generation_prompt
        history = before.prompt_ids[: -len(generation_prompt)]
        assert after.prompt_ids[: len(history)] == history

    # A call whose request carries an assistant turn continues the previous sample; one that
    # carries none (mini-swe-agent dropped the unparseable answer) starts a new one. With the
    # random model that is every call: as many samples as calls, and that is the right merge.
    def carries_assistant(call: LLMCallCompleted) -> bool:
        return any(m.get("role") == "assistant" for m in call.request["messages"])

    samples = build_samples(calls)
    assert len(samples) == 1 + sum(not carries_assistant(c) for c in calls[1:])
    print(f"mini-swe-agent on the random model: {len(calls)} calls -> {len(samples)} samples")


async def test_mini_swe_agent_tool_calls_splice_into_one_sample(
    app: Appliance,
    tokenizer: Tokenizer,
    workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = ScriptedEngine(
        tokenizer,
        [
            tool_call("cat numbers.txt", "Let me read the numbers first."),
            tool_call("awk '{s += $1} END {print s}' numbers.txt > sum.txt", "They add up to 6."),
            tool_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "Done."),
        ],
    )
    monkeypatch.setattr(app.engine, "generate", engine.generate)
    active = rollout(app)
    run = await run_mini(app, active, workdir, tmp_path)
    calls = await calls_of(app, active.rollout)

    # mini-swe-agent ran every command it was given and submitted.
    assert run.returncode == 0, run.output
    assert run.exit_status == "Submitted", run.output
    assert (workdir / "sum.txt").read_text() == "6\n"
    assert len(calls) == 3
    check_harness_calls(run, calls, tokenizer)
    assert [c.finish_reason for c in calls] == ["stop"] * 3
    assert engine.prompts == [c.prompt_ids for c in calls]

    # Each call re-sends the earlier assistant turns (with their tool calls) and tool results:
    # the proxy splices the sampled tokens back in, so each prompt extends the previous call.
    for before, after in itertools.pairwise(calls):
        assert after.spliced_tokens == before.spliced_tokens + len(before.response_ids)
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.response_ids)] == (
            before.prompt_ids + before.response_ids
        )
    second_messages = calls[1].request["messages"]
    assert [m["role"] for m in second_messages] == ["system", "user", "assistant", "tool"]
    assert second_messages[2]["tool_calls"][0]["function"]["name"] == "bash"
    assert "1\\n2\\n3" in second_messages[3]["content"]  # the observation of `cat numbers.txt`

    (sample,) = build_samples(calls)
    assert sample.call_ids == tuple(c.call_id for c in calls)
    assert sample.tokens[: len(calls[0].prompt_ids)] == calls[0].prompt_ids
    assert sampled_tokens([sample]) == tuple(t for c in calls for t in c.response_ids)
    sampled_logprobs = {lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m}
    assert sampled_logprobs == {ScriptedEngine.LOGPROB}
    assert sample.num_sampled == sum(len(c.response_ids) for c in calls)
