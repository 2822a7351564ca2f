"""One run of the tiny model (two steps, TensorBoard on), read on every surface: ``/metrics``'
training figures (rewards and rollout durations as histograms, the last step's loss, entropy,
KL, gradient norm, version lag and memory), the Grafana dashboard's queries checked against
that live scrape, and the token figures (sampled, trained, prompt) that the log, ``status``, the
dashboard, TensorBoard and ``/metrics`` each give for the same run."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.app import Appliance
from appliance.cli.status import _print_status, status_report
from appliance.proxy.run_metrics import cuda_in_use
from store.events import LLMCallCompleted, TrainStepCompleted
from store.eventstore import read_events_sync
from store.projections import RunState
from store.token_figures import step_tokens, tokens_text
from tests.appliance.appliance_process import ROOT
from tests.appliance.proxy.test_metrics import Samples, parse, scrape, value
from tests.appliance.reporting.test_trackers import tensorboard_scalars
from tests.support import make_config
from trainer.samples import build_samples
from tui.model import DashboardModel, describe

DASHBOARD = ROOT / "docs" / "grafana" / "lightning-appliance.json"
GIB = 1024**3
#: Families that have no sample where torch has not started CUDA in the process.
GPU_ONLY = {
    "appliance_gpu_memory_allocated_bytes",
    "appliance_gpu_memory_reserved_bytes",
    "appliance_step_gpu_memory_peak_bytes",
}
#: Words of PromQL that are not metric names.
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}


@dataclass
class Run:
    data_dir: Path
    #: The last scrape, after the run's second step, as text and as samples.
    text: str
    samples: Samples
    state: RunState


@pytest.fixture
async def run(tmp_path: Path, tiny_model_dir: Path) -> Run:
    config = make_config(tmp_path, tiny_model_dir, max_steps=2, loggers=("console", "tensorboard"))
    async with Appliance(config) as app:
        assert await app.run() == "reached step 2"
        text = (await scrape(app, app.admin_token))[2]
    db = tmp_path / "run" / "events.sqlite"
    return Run(tmp_path / "run", text, parse(text), RunState.from_events(read_events_sync(db)))


def exported(text: str) -> dict[str, int]:
    """Every name a scrape exports (families and their samples' names) and its sample count."""
    names: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        names[family.name] = names.get(family.name, 0) + len(family.samples)
        for sample in family.samples:
            names[sample.name] = names.get(sample.name, 0) + 1
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers outside label matchers, ranges,
    strings and grouping clauses, that are neither functions nor PromQL's own words."""
    bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]', " ", expr)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    found = re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", bare)
    return {m.group() for m in found if m.group() not in PROMQL_WORDS and not _followed_by_paren(bare, m)}


def _followed_by_paren(text: str, match: re.Match[str]) -> bool:
    return text[match.end() :].lstrip().startswith("(")


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def test_the_dashboard_parser_finds_metric_names() -> None:
    expr = 'histogram_quantile(0.9, sum by (le, p) (rate(appliance_x_bucket{p="train"}[5m]))) / b_total'
    assert metric_names(expr) == {"appliance_x_bucket", "b_total"}


async def test_every_dashboard_query_names_a_metric_the_appliance_exports(run: Run) -> None:
    names = exported(run.text)
    cuda = cuda_in_use()
    read = set()
    for title, expr in dashboard_exprs():
        for name in metric_names(expr):
            assert name in names, f"{title}: {expr} reads {name}, which /metrics does not export"
            if not (name in GPU_ONLY and not cuda):
                assert names[name] > 0, f"{title}: {name} has no sample after two steps"
            read.add(name)
    # The dashboard shows what a Prometheus user asks for first.
    for wanted in (
        "appliance_rollout_reward_bucket", "appliance_rollout_duration_seconds_bucket",
        "appliance_step_policy_loss", "appliance_step_entropy_nats", "appliance_step_kl_old_nats",
        "appliance_step_grad_norm", "appliance_step_policy_version_lag", "process_resident_memory_bytes",
        "appliance_gpu_memory_allocated_bytes", "appliance_sampled_tokens_total",
        "appliance_trained_tokens_total",
    ):  # fmt: skip
        assert wanted in read, wanted


async def test_metrics_has_the_runs_training_figures(run: Run) -> None:
    samples, state = run.samples, run.state
    step = state.steps[-1]
    ended = [
        v for v in state.rollouts.values() if v.purpose == "train" and v.status in ("finished", "failed")
    ]
    rewarded = [v for v in ended if v.status == "finished" and v.reward is not None]
    assert len(rewarded) >= 8
    # Histograms: every ended rollout's duration, every finished one's reward.
    train = {"purpose": "train"}
    assert value(samples, "appliance_rollout_reward_count", **train) == len(rewarded)
    assert value(samples, "appliance_rollout_reward_sum", **train) == pytest.approx(
        sum(v.reward or 0.0 for v in rewarded)
    )
    assert value(samples, "appliance_rollout_reward_bucket", le="+Inf", **train) == len(rewarded)
    assert value(samples, "appliance_rollout_reward_bucket", le="1.0", **train) == sum(
        1 for v in rewarded if (v.reward or 0.0) <= 1.0
    )
    assert value(samples, "appliance_rollout_duration_seconds_count", **train) == len(ended)
    assert value(samples, "appliance_rollout_duration_seconds_sum", **train) == pytest.approx(
        sum(v.duration_s or 0.0 for v in ended)
    )
    # The last step's figures, as its event recorded them.
    metrics = step.metrics
    for name, key in (
        ("appliance_step_reward_mean", "reward_mean"), ("appliance_step_policy_loss", "loss"),
        ("appliance_step_entropy_nats", "entropy"), ("appliance_step_kl_old_nats", "ppo_kl"),
        ("appliance_step_kl_ref_nats", "kl_ref"), ("appliance_step_grad_norm", "grad_norm"),
        ("appliance_step_trained_tokens_per_second", "tokens_per_s"),
    ):  # fmt: skip
        assert value(samples, name) == pytest.approx(metrics[key]), name
    assert value(samples, "appliance_step_policy_version_lag", stat="max") == metrics["staleness_max"]
    assert value(samples, "appliance_step_duration_seconds") == pytest.approx(step.duration_s)
    assert value(samples, "appliance_published_policy_version") == 2
    # Memory: the process now, and what the step recorded; no GPU figure on CPU.
    assert value(samples, "process_resident_memory_bytes") > 100 * 1024**2
    assert value(samples, "appliance_step_resident_memory_bytes", process="appliance") == pytest.approx(
        metrics["memory_rss_gib"] * GIB
    )
    assert not [key for key in samples if key[0].startswith("appliance_gpu_memory")]


async def test_each_token_figure_is_one_number_on_every_surface(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """sampled, trained and prompt: the log's own count, status (JSON and text), the dashboard,
    TensorBoard and /metrics give the same number under the same name."""
    stored = read_events_sync(run.data_dir / "events.sqlite")
    events = [s.event for s in stored]
    calls = [e for e in events if isinstance(e, LLMCallCompleted)]
    steps = [e for e in events if isinstance(e, TrainStepCompleted)]
    # The definitions, counted from the log itself.
    sampled = sum(len(c.response_ids) for c in calls)
    prompt = sum(len(c.prompt_ids) for c in calls)
    by_rollout = {r: [c for c in calls if c.rollout == r] for r in {c.rollout for c in calls}}
    per_step = []
    for step in steps:
        trained = sum(
            sum(sample.loss_mask) for r in step.rollouts for sample in build_samples(by_rollout.get(r, []))
        )
        step_calls = [c for r in step.rollouts for c in by_rollout.get(r, [])]
        per_step.append(
            {
                "sampled": sum(len(c.response_ids) for c in step_calls),
                "trained": trained,
                "prompt": sum(len(c.prompt_ids) for c in step_calls),
            }
        )
        assert step_tokens(step) == per_step[-1]
        assert 0 < per_step[-1]["trained"] <= per_step[-1]["sampled"] < step.tokens
    run_figures = {"sampled": sampled, "trained": sum(s["trained"] for s in per_step), "prompt": prompt}

    # status, JSON and text.
    summary = status_report(run.data_dir)
    assert {name: summary[f"tokens_{name}"] for name in run_figures} == run_figures
    assert [{n: d[f"tokens_{n}"] for n in run_figures} for d in summary["steps_detail"]] == per_step
    _print_status(summary)
    text = capsys.readouterr().out
    assert tokens_text(run_figures) in text
    for figures in per_step:
        assert tokens_text(figures, 5) in text

    # The dashboard: the run's life line and each step's line in the event log.
    model = DashboardModel()
    model.extend(stored)
    life = model.life()
    assert (life.sampled, life.trained) == (sampled, run_figures["trained"])
    for step, figures in zip(steps, per_step, strict=True):
        assert tokens_text(figures) in describe(step)

    # TensorBoard (W&B and MLflow are written the same row): tokens/<name> at each step.
    scalars = tensorboard_scalars(run.data_dir / "tracking" / "tensorboard" / "run")
    for name in run_figures:
        assert [v for _, v in scalars[f"tokens/{name}"]] == [float(f[name]) for f in per_step], name
    assert "train/tokens" not in scalars

    # /metrics: the run's counters under appliance_<name>_tokens_total.
    def total(name: str) -> float:
        return sum(v for (n, _), v in run.samples.items() if n == f"appliance_{name}_tokens_total")

    assert {name: total(name) for name in run_figures} == run_figures
