"""Preflight: a start that cannot work fails in one line (exit 2) before anything loads, and
writes nothing to the store; one appliance per data directory.

The command-line cases run ``lightning-appliance up`` in a subprocess, the way a user runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from appliance.app import Appliance
from appliance.config import ApplianceConfig
from appliance.operations import preflight
from appliance.placement.plan import Machine
from contracts.errors import PreflightFailed
from store.events import ApplianceStarted, ApplianceStopped
from store.eventstore import EventStore, read_events_sync
from tests.appliance.appliance_process import ROOT
from tests.appliance.appliance_process import cli as run_cli
from tests.support import make_config

#: Preflight answers before the model loads.
FAST_S = 30.0
#: The refusals that need no model come before torch is imported: about 0.3 s here.
BEFORE_TORCH_S = 5.0
#: Modules the command line must not have imported when it refuses a start in one line.
HEAVY = ("torch", "transformers", "tokenizers", "vllm", "verl")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def up(data_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``up`` of the tiny model on ``data_dir``, expected to be refused; returns it and its seconds."""
    started = time.monotonic()
    done = cli("up", "--headless", "--model", "tiny", "--data-dir", str(data_dir), "--steps", "1", *extra)
    return done, time.monotonic() - started


def up_traced(data_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float, set[str]]:
    """:func:`up` under ``python -X importtime``: the refusal (stderr without the import lines),
    its seconds, and every module it imported."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "appliance.cli", "up", "--headless", "--model", "tiny",
         "--data-dir", str(data_dir), "--steps", "1", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    seconds = time.monotonic() - started
    lines = done.stderr.splitlines(keepends=True)
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    done.stderr = "".join(line for line in lines if not line.startswith("import time:"))
    return done, seconds, imported


def assert_refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit status 2 and exactly one line, ``lightning-appliance: ...`` naming ``words``."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("lightning-appliance: ")
    for word in words:
        assert word in lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def config(tmp_path: Path, **overrides: object) -> ApplianceConfig:
    return make_config(tmp_path, Path("tiny"), model="tiny", max_steps=1, **overrides)


# --- one appliance per data directory ------------------------------------------------------


async def test_a_second_appliance_on_a_locked_data_dir_fails_naming_the_holder(tmp_path: Path) -> None:
    async with Appliance(config(tmp_path)) as first:
        lock = first.config.data_dir / preflight.LOCK_NAME
        assert lock.read_text().strip() == str(os.getpid())
        before = await first.store.read()

        done, seconds = await asyncio.to_thread(up, first.config.data_dir, "--port", "0")
        assert_refused(done, f"another appliance (pid {os.getpid()}) is running on {first.config.data_dir}")
        assert seconds < FAST_S
        with pytest.raises(PreflightFailed, match=f"pid {os.getpid()}"):
            async with Appliance(first.config):
                pass

        # The first one's store is untouched and it keeps running.
        assert await first.store.read() == before
        assert await first.run() == "reached step 1"
    assert lock.read_text() == ""  # released, and no stale pid left in it
    with preflight.data_dir_lock(first.config.data_dir):
        pass


async def test_refusals_that_need_no_model_come_before_torch_is_imported(
    tmp_path: Path, taken_port: int
) -> None:
    locked, model, disk = tmp_path / "locked", tmp_path / "model", tmp_path / "disk"
    model.mkdir()
    await record_start(model / "events.sqlite", "smollm2-135m")
    (tmp_path / "big.toml").write_text("min_free_disk_gib = 1e9\n")
    cases = [
        (locked, ("--port", "0"), f"another appliance (pid {os.getpid()}) is running on {locked}"),
        (tmp_path / "port", ("--port", str(taken_port)), f"port {taken_port}"),
        (disk, ("--port", "0", "--config", str(tmp_path / "big.toml")), "min_free_disk_gib"),
        (model, ("--port", "0"), "this run was trained with model 'smollm2-135m'"),
    ]
    with preflight.data_dir_lock(locked):
        for data_dir, extra, words in cases:
            done, seconds, imported = await asyncio.to_thread(up_traced, data_dir, *extra)
            assert_refused(done, words)
            assert seconds < BEFORE_TORCH_S, (words, seconds)
            assert not imported & set(HEAVY), (words, sorted(imported & set(HEAVY)))
            traced = {"appliance.cli", "appliance.operations.preflight"}
            assert traced & imported  # (it was traced)


def test_eval_on_a_locked_data_dir_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    with preflight.data_dir_lock(locked):
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "appliance.cli", "eval", "--model", "tiny",
             "--data-dir", str(locked), "--port", "0"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        seconds = time.monotonic() - started
    lines = done.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    done.stderr = "".join(line + "\n" for line in lines if not line.startswith("import time:"))
    assert_refused(done, f"another appliance (pid {os.getpid()}) is running on {locked}")
    assert seconds < BEFORE_TORCH_S, seconds
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_lock_claimed_before_the_imports_is_lent_to_one_appliance(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with preflight.claim(cfg) as path:
        assert path.read_text().strip() == str(os.getpid())
        with (
            preflight.data_dir_lock(cfg.data_dir),  # the Appliance the command line builds
            pytest.raises(PreflightFailed, match="another appliance"),
            preflight.data_dir_lock(cfg.data_dir),  # a second one in the same process
        ):
            pass
        with preflight.data_dir_lock(cfg.data_dir):  # lent again after the first let go
            pass
    assert path.read_text() == ""
    with preflight.data_dir_lock(cfg.data_dir):  # released
        pass


def test_the_data_dir_is_owner_only_while_locked(tmp_path: Path) -> None:
    data_dir = tmp_path / "new" / "run"
    before = os.umask(0o022)
    try:
        with preflight.data_dir_lock(data_dir) as lock:
            probe = data_dir / "probe"
            probe.write_text("x")
            (data_dir / "sub").mkdir()
            assert {p.name: p.stat().st_mode & 0o777 for p in (data_dir, lock, probe, data_dir / "sub")} == {
                "run": 0o700,
                preflight.LOCK_NAME: 0o600,
                "probe": 0o600,
                "sub": 0o700,
            }
        assert os.umask(0o022) == 0o022  # the process's own umask is back
        with preflight.data_dir_lock(tmp_path / "shared", umask=0o027):  # data_umask = "027"
            assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o750
    finally:
        os.umask(before)


def test_the_lock_is_released_when_the_holder_exits_or_fails(tmp_path: Path) -> None:
    data_dir = tmp_path / "run"
    with pytest.raises(RuntimeError), preflight.data_dir_lock(data_dir):
        raise RuntimeError("boom")
    with (
        preflight.data_dir_lock(data_dir),
        pytest.raises(PreflightFailed, match=f"another appliance \\(pid {os.getpid()}\\)"),
        preflight.data_dir_lock(data_dir),
    ):
        pass
    with preflight.data_dir_lock(data_dir):
        pass


async def test_a_failed_start_releases_the_lock_and_records_nothing(tmp_path: Path) -> None:
    cfg = config(tmp_path, min_free_disk_gib=1e9)
    with pytest.raises(PreflightFailed, match="min_free_disk_gib"):
        async with Appliance(cfg):
            pass
    assert sorted(p.name for p in cfg.data_dir.iterdir()) == [preflight.LOCK_NAME]
    with preflight.data_dir_lock(cfg.data_dir):
        pass


# --- the port ---------------------------------------------------------------------------------


def test_a_port_in_use_is_refused_in_one_line_before_the_model_loads(tmp_path: Path, taken_port: int) -> None:
    data_dir = tmp_path / "run"
    done, seconds = up(data_dir, "--port", str(taken_port))
    assert_refused(done, f"port {taken_port}", "--port")
    assert seconds < FAST_S
    assert not (data_dir / "models").exists(), "the model was built before the port was checked"
    assert not (data_dir / "events.sqlite").exists()


async def test_a_port_taken_after_preflight_fails_in_one_line_and_records_nothing(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race: the port is free when preflight looks, taken when the proxy binds.
    monkeypatch.setattr(preflight, "check_port", lambda host, port: None)
    cfg = config(tmp_path, port=taken_port)
    with pytest.raises(PreflightFailed, match=f"port {taken_port} on 127.0.0.1 is already in use"):
        async with Appliance(cfg):
            pass
    events = [s.event for s in read_events_sync(cfg.db_path)]
    assert not [e for e in events if isinstance(e, ApplianceStarted | ApplianceStopped)]


# --- the data directory and the disk --------------------------------------------------------


def test_a_data_dir_that_cannot_be_created_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    data_dir = tmp_path / "file" / "run"  # unwritable for root too
    done, seconds = up(data_dir, "--port", "0")
    assert_refused(done, f"data directory {data_dir} is not writable")
    assert seconds < FAST_S


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into a 0o555 directory; the case above covers root"
)
def test_a_read_only_data_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "run"
    data_dir.mkdir()
    data_dir.chmod(0o555)
    try:
        done, _ = up(data_dir, "--port", "0")
    finally:
        data_dir.chmod(0o755)
    assert_refused(done, f"data directory {data_dir} is not writable")
    assert list(data_dir.iterdir()) == []


def test_too_little_free_disk_is_refused_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "run"
    (tmp_path / "big.toml").write_text("min_free_disk_gib = 1e9\n")
    done, seconds = up(data_dir, "--port", "0", "--config", str(tmp_path / "big.toml"))
    assert_refused(done, "GiB free", "min_free_disk_gib")
    assert seconds < FAST_S
    assert not (data_dir / "models").exists()
    assert not (data_dir / "events.sqlite").exists()


# --- the engine ---------------------------------------------------------------------------


def test_an_unknown_engine_is_refused_in_one_line_before_the_model_loads(tmp_path: Path) -> None:
    data_dir = tmp_path / "run"
    done, seconds = up(data_dir, "--port", "0", "--engine", "tensorrt")
    assert_refused(done, "'tensorrt'", "torch", "vllm")
    assert seconds < FAST_S
    assert not data_dir.exists()


async def test_an_appliance_built_with_an_unknown_engine_writes_nothing(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    object.__setattr__(cfg.engine, "kind", "tensorrt")  # past the config's own check
    with pytest.raises(PreflightFailed, match="unknown engine 'tensorrt'"):
        async with Appliance(cfg):
            pass
    assert not cfg.db_path.exists()
    assert not cfg.models_dir.exists()


# --- the run's model ------------------------------------------------------------------------


async def record_start(db: Path, model: str) -> list[object]:
    """A store whose last start used ``--model model``; returns its events."""
    async with await EventStore.open(db) as store:
        await store.append(
            [
                ApplianceStarted(
                    ts=1.0,
                    run_id="r",
                    model=model,
                    engine="torch",
                    resumed_from_version=0,
                    resumed_from_step=0,
                    config={"model": model},
                )
            ]
        )
        return [s.event for s in await store.read()]


async def test_another_model_than_the_runs_is_refused_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "run"
    data_dir.mkdir()
    before = await record_start(data_dir / "events.sqlite", "smollm2-135m")

    done, seconds = await asyncio.to_thread(up, data_dir, "--port", "0")
    assert_refused(
        done,
        "this run was trained with model 'smollm2-135m'; start it with --model smollm2-135m"
        " or use another --data-dir",
    )
    assert seconds < FAST_S
    assert not (data_dir / "models").exists()
    assert [s.event for s in read_events_sync(data_dir / "events.sqlite")] == before

    with pytest.raises(PreflightFailed, match="trained with model 'smollm2-135m'"):
        async with Appliance(config(tmp_path)):
            pass
    assert [s.event for s in read_events_sync(data_dir / "events.sqlite")] == before


async def test_the_runs_model_directory_by_another_path_is_accepted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data_dir = tmp_path / "run"
    data_dir.mkdir()
    await record_start(data_dir / "events.sqlite", str(tiny_model_dir))
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / tiny_model_dir.name
    link.symlink_to(tiny_model_dir)

    for model in (str(tiny_model_dir), str(link)):
        preflight.check_model(dataclasses.replace(config(tmp_path), model=model))
    with pytest.raises(PreflightFailed, match=f"trained with model '{tiny_model_dir}'"):
        preflight.check_model(config(tmp_path))  # the registered "tiny" is another model


# --- the placement plan ---------------------------------------------------------------------

#: Llama-2-70B's shape: a model directory holding its config.json alone is all the plan reads.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def model_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_model_this_machine_cannot_train_is_refused_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "run"
    big = model_dir(tmp_path, LLAMA_70B)
    done, seconds = up(data_dir, "--port", "0", "--device", "cpu", "--model", str(big))
    assert_refused(done, "placement: the engine and 1 trainer rank(s) (full fine-tune) need", "of host RAM")
    assert seconds < FAST_S
    assert not (data_dir / "models").exists()
    assert not (data_dir / "events.sqlite").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_refused_in_one_line(tmp_path: Path) -> None:
    done, seconds = up(tmp_path / "run", "--port", "0", "--device", "cuda")
    assert_refused(done, "placement: device = cuda but no GPU was found", "--device cpu")
    assert seconds < FAST_S


def test_a_plan_that_does_not_fit_the_gpus_is_refused_naming_the_fix(tmp_path: Path) -> None:
    qwen_7b = {**LLAMA_70B, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064}  # fmt: skip
    # The verl trainer computes in bf16 on GPUs, and vLLM serves in it (the torch backend: fp32).
    cfg = dataclasses.replace(
        config(tmp_path, trainer="verl"), model=str(model_dir(tmp_path, qwen_7b)), device="cuda"
    )
    one_24_gib = Machine.described(1, 24 * 1024**3, 64 * 1024**3)
    with pytest.raises(PreflightFailed) as refused:
        preflight.check_placement(cfg, one_24_gib)
    line = refused.value.message
    assert line.startswith("placement: the trainer needs ") and "\n" not in line
    assert "GPU 0 has 22.5 GiB for it" in line and "a smaller model" in line
    # What the line suggests fits: the model on three such GPUs, with LoRA and recomputation.
    fixed = cfg.replace(lora_rank=16, gradient_checkpointing=True)
    plan = preflight.check_placement(fixed, Machine.described(3, 24 * 1024**3, 256 * 1024**3))
    assert plan is not None and plan.fits and plan.trainer_gpus == (0, 1, 2)
    # A vLLM server of its own already holds its memory: the plan is logged, not enforced.
    attached = cfg.replace(engine="vllm", vllm_url="http://127.0.0.1:8000")
    plan = preflight.check_placement(attached, one_24_gib)
    assert plan is not None and not plan.fits


def test_the_default_models_pass_the_placement_check_on_cpu(tmp_path: Path) -> None:
    for model in ("tiny", "smollm2-135m"):
        plan = preflight.check_placement(dataclasses.replace(config(tmp_path), model=model, device="cpu"))
        assert plan is not None and plan.fits and plan.device == "cpu"
    unknown = dataclasses.replace(config(tmp_path), model=str(tmp_path / "nothing-here"))
    assert preflight.check_placement(unknown) is None  # loading the model says why
