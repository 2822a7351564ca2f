"""Experiment trackers (``appliance.reporting.trackers``): a tiny run's step figures read back from
TensorBoard's event files with TensorBoard's own reader, from W&B's offline run directory and
from MLflow's store, on the policy-version axis, continued by a resumed run; a tracker that is
not installed refused in one line at start."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.app import Appliance
from appliance.reporting.trackers import check_backends
from contracts.errors import ConfigError
from store.events import PolicyVersionPublished, TrainStepCompleted, ValidationCompleted
from store.eventstore import read_events_sync
from tests.appliance.appliance_process import ROOT
from tests.support import make_config

HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard log directory, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def wandb_history(run_dir: Path) -> list[dict[str, str]]:
    """The history rows of every offline run under ``run_dir``/wandb, oldest run first: the
    records of each ``run-*.wandb`` file (a LevelDB-style log of ``Record`` protos)."""
    from wandb.proto import wandb_internal_pb2

    rows: list[dict[str, str]] = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, position, block, pieces = path.read_bytes(), 7, 32768, b""
        while position + 7 <= len(data):
            left = block - position % block
            _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
            if left < 7 or (length == 0 and kind == 0):  # the block's padding
                position += left
                continue
            pieces += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record()  # type: ignore[attr-defined, unused-ignore]
                record.ParseFromString(pieces)
                pieces = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
    return rows


def tensorboard_histograms(directory: Path) -> dict[str, list[tuple[int, float, float, float]]]:
    """Every histogram of a TensorBoard log directory: (step, count, min, max) per point."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"histograms": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.histogram_value.num, e.histogram_value.min, e.histogram_value.max) for e in events]
        for tag in accumulator.Tags()["histograms"]
        if (events := accumulator.Histograms(tag))
    }


@pytest.fixture
def offline_wandb(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield


async def run_steps(tmp_path: Path, model_dir: Path, steps: int, loggers: tuple[str, ...]) -> Appliance:
    config = make_config(tmp_path, model_dir, max_steps=steps, loggers=loggers, validate_every=1)
    async with Appliance(config) as app:
        assert await app.run() == f"reached step {steps}"
    return app


async def test_a_resumed_run_continues_its_curves_on_the_policy_version_axis(
    tmp_path: Path, tiny_model_dir: Path, offline_wandb: None
) -> None:
    """TensorBoard (and W&B offline, where installed): a run of one step, then the same data
    directory resumed for a second; each step's figures at the version it published."""
    loggers = ("console", "tensorboard", *(("wandb",) if HAS_WANDB else ()))
    first = await run_steps(tmp_path, tiny_model_dir, 1, loggers)
    assert first.tracker is not None
    assert str(tmp_path / "run" / "tracking" / "tensorboard" / "run") in first.tracker.describe()
    await run_steps(tmp_path, tiny_model_dir, 2, loggers)  # the same data directory, resumed
    steps, versions, rounds = recorded(tmp_path)

    scalars = tensorboard_scalars(tmp_path / "run" / "tracking" / "tensorboard" / "run")
    # One point per step, at the version it published, across both starts; nothing twice.
    assert [step for step, _ in scalars["train/policy_loss"]] == versions
    assert scalars["tokens/trained"] == [
        (v, s.metrics["tokens_trained"]) for v, s in zip(versions, steps, strict=True)
    ]
    assert [round(v, 5) for _, v in scalars["train/entropy"]] == [
        round(s.metrics["entropy"], 5) for s in steps
    ]
    for name in (
        "reward/train_mean", "reward/train_std", "train/grad_norm", "train/clip_fraction", "train/kl_old",
        "train/samples_per_rollout", "staleness/mean", "staleness/max", "staleness/tokens_masked",
        "time/step_s", "time/switch_s", "time/generate_s", "throughput/rollouts_per_s", "memory/host_rss_gib",
    ):  # fmt: skip
        assert [step for step, _ in scalars[name]] == versions, name
    assert [step for step, _ in scalars["reward/validation_mean"]] == [r.policy_version for r in rounds]

    if HAS_WANDB:
        history = wandb_history(tmp_path / "run" / "tracking")
        assert len(list((tmp_path / "run" / "tracking").glob("wandb/offline-run-*"))) == 2  # one per start
        ids = {
            path.name.rsplit("-", 1)[1]
            for path in (tmp_path / "run" / "tracking").glob("wandb/offline-run-*")
        }
        assert len(ids) == 1  # the same W&B run id: `wandb sync` puts both into one run
        trained = [row for row in history if "train/policy_loss" in row]
        assert [int(row["_step"]) for row in trained] == versions
        assert [float(row["tokens/trained"]) for row in trained] == [
            s.metrics["tokens_trained"] for s in steps
        ]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (make tracking)")
async def test_a_resumed_run_logs_to_the_same_mlflow_run(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = await run_steps(tmp_path, tiny_model_dir, 1, ("mlflow",))
    await run_steps(tmp_path, tiny_model_dir, 2, ("mlflow",))
    steps, versions, _ = recorded(tmp_path)
    assert first.tracker is not None
    client = mlflow.MlflowClient(first.tracker.mlflow_uri)
    experiment = client.get_experiment_by_name("lightning-appliance")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # resumed, not a second run
    history = client.get_metric_history(runs[0].info.run_id, "tokens/trained")
    assert [(m.step, m.value) for m in history] == [
        (v, s.metrics["tokens_trained"]) for v, s in zip(versions, steps, strict=True)
    ]


def recorded(tmp_path: Path) -> tuple[list[TrainStepCompleted], list[int], list[ValidationCompleted]]:
    """The run's steps, the versions they published and its validation rounds, from its log."""
    events = [s.event for s in read_events_sync(tmp_path / "run" / "events.sqlite")]
    steps = [e for e in events if isinstance(e, TrainStepCompleted)]
    versions = [e.policy_version for e in events if isinstance(e, PolicyVersionPublished)]
    rounds = [e for e in events if isinstance(e, ValidationCompleted)]
    assert versions == [1, 2] and len(steps) == 2 and len(rounds) >= 2
    return steps, versions, rounds


async def test_tensorboard_has_each_steps_rewards_and_rollout_lengths_as_histograms(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Per step: a histogram of its rewards and one of its rollouts' sampled tokens, and the
    generation rate as a scalar, read back from the event file with TensorBoard's reader."""
    await run_steps(tmp_path, tiny_model_dir, 2, ("tensorboard",))
    steps, versions, _ = recorded(tmp_path)
    directory = tmp_path / "run" / "tracking" / "tensorboard" / "run"
    histograms = tensorboard_histograms(directory)
    assert histograms["reward/train"] == [
        (v, len(s.rewards), min(s.rewards), max(s.rewards)) for v, s in zip(versions, steps, strict=True)
    ]
    assert all(len(s.rewards) == 4 for s in steps)  # two groups of two, none failed
    assert histograms["rollout/sampled_tokens"] == [
        (v, len(s.sampled), min(s.sampled), max(s.sampled)) for v, s in zip(versions, steps, strict=True)
    ]
    assert [sum(s.sampled) for s in steps] == [s.metrics["tokens_sampled"] for s in steps]
    scalars = tensorboard_scalars(directory)
    rates = dict(scalars["throughput/generation_tokens_per_s"])
    generate = dict(scalars["time/generate_s"])
    for version, step in zip(versions, steps, strict=True):
        assert rates[version] == pytest.approx(sum(step.sampled) / generate[version], rel=1e-5)
        assert rates[version] > 0


def test_a_tracker_that_is_not_installed_is_refused_before_anything_loads(tmp_path: Path) -> None:
    # wandb seen as missing (whether or not this venv has it): one line, exit 2, nothing written.
    program = (
        "import sys, appliance.reporting.trackers as t; t.installed = lambda module: module != 'wandb'; "
        "from appliance.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", program, "up", "--headless", "--model", "tiny", "--port", "0",
         "--data-dir", str(tmp_path / "run"), "--loggers", "tensorboard,wandb"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert time.monotonic() - started < 5.0  # refused before torch and the model load
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "lightning-appliance: loggers: wandb needs the wandb package: "
        "pip install -e '.[tracking]' (make tracking)"
    ]
    assert not (tmp_path / "run" / "events.sqlite").exists()


def test_check_backends_names_each_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    check_backends(("console",))  # console needs nothing
    monkeypatch.setattr("appliance.reporting.trackers.installed", lambda module: False)
    with pytest.raises(ConfigError, match=r"^loggers: wandb needs .*; mlflow needs the mlflow package"):
        check_backends(("wandb", "mlflow", "console"))
