"""The progress line of ``up --headless`` and ``status`` over the same run: one reward rule
(``RunState.step_reward``), and the step's loss as recorded, to 3 significant digits."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.cli import main
from appliance.cli.common import loss_text
from appliance.cli.status import status_report
from appliance.cli.up import progress_line
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from store.events import LLMCallCompleted, RewardReported, RolloutCreated, RolloutFinished, TrainStepCompleted
from store.projections import RunState
from store.token_figures import tokens_text
from store.tokens import Tokens
from tests.support import make_config


def skipping_agent() -> PythonAdapter:
    """The first rollout reports 0 without a model call (nothing to train on: it is failed);
    every other one calls the model once and scores 1."""
    started = itertools.count()

    async def agent(task: Task, client: ClientConfig) -> float:
        if next(started) == 0:
            return 0.0
        async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
            await oai.chat.completions.create(
                model=client.model,
                messages=[{"role": "user", "content": task.data["question"]}],
                max_tokens=4,
            )
        return 1.0

    return PythonAdapter(agent)


async def test_progress_line_and_status_agree_on_a_rollout_that_made_no_call(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=1)
    lines: list[str] = []

    def on_step(step: TrainStepCompleted, state: RunState) -> None:
        lines.append(progress_line(step, state, 0.0, 0))

    async with Appliance(config, on_step=on_step, adapter=skipping_agent()) as app:
        assert await app.run() == "reached step 1"
        state = app.live.state
    (step,) = state.steps
    callless = [state.rollouts[r] for r in step.rollouts if not state.rollouts[r].call_count]
    assert len(callless) == 1 and callless[0].reward == 0.0 and len(step.rollouts) == 4
    # Failed for it, so its 0 is not averaged in: the three others scored 1.
    assert callless[0].status == "failed" and callless[0].error.startswith("made no model call")

    (line,) = lines
    assert "reward 1.000  " in line and "failed 1: made no model call" in line
    report = status_report(config.data_dir)
    assert report["mean_reward"] == pytest.approx(1.0)
    assert report["steps_detail"][0]["reward_mean"] == pytest.approx(1.0)
    # The metric the step recorded (the dashboard's curve) follows the same rule.
    assert step.metrics["reward_mean"] == pytest.approx(1.0)
    assert main(["status", "--data-dir", str(config.data_dir)]) == 0
    out = capsys.readouterr().out
    assert "last step mean reward 1.000" in out
    assert f"reward 1.000  loss {loss_text(step.metrics['loss'])}" in out
    # The step line names the token figures as status does, with the same numbers.
    detail = report["steps_detail"][0]
    figures = {name: detail[f"tokens_{name}"] for name in ("sampled", "trained", "prompt")}
    assert all(isinstance(v, int) and v > 0 for v in figures.values()), figures
    assert tokens_text(figures, 5) in line


def one_step(loss: float | None) -> tuple[TrainStepCompleted, RunState]:
    """A state holding one finished, rewarded rollout and the step that consumed it."""
    state = RunState()
    metrics = {} if loss is None else {"loss": loss}
    step = TrainStepCompleted(
        ts=2.0,
        step=1,
        rollouts=("r",),
        samples=1,
        tokens=3,
        zero_variance_groups=0,
        metrics=metrics,
        duration_s=0.5,
    )
    for event in (
        RolloutCreated(
            ts=1.0, rollout="r", task_id="t", group="g", task={}, policy_version=0, adapter="python"
        ),
        LLMCallCompleted(
            ts=1.1,
            rollout="r",
            call_id="c",
            surface="openai.chat",
            prompt_ids=Tokens((1, 2)),
            response_ids=Tokens((3,)),
            response_logprobs=(-0.5,),
            policy_version=0,
            finish_reason="stop",
            request={},
            response_text="3",
            queue_s=0.0,
            total_s=0.1,
        ),
        RewardReported(ts=1.2, rollout="r", reward=0.5, source="agent"),
        RolloutFinished(ts=1.3, rollout="r", status="finished"),
        step,
    ):
        state.apply(event)
    return step, state


@pytest.mark.parametrize(
    ("loss", "shown"),
    [
        (-0.0123, "loss -0.0123"),
        (1.23e-05, "loss 1.23e-05"),
        (0.25, "loss 0.25"),
        (0.0, "loss 0"),
        (None, "loss -"),
    ],
)
def test_progress_line_shows_the_step_loss_to_three_significant_digits(
    loss: float | None, shown: str
) -> None:
    step, state = one_step(loss)
    line = progress_line(step, state, 0.0, 0)
    assert f"{shown}  " in line
    assert "reward 0.500  " in line
