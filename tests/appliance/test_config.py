"""Config assembly: defaults < TOML file < APPLIANCE_* environment < explicit overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.config import load_config
from appliance.errors import ConfigError


def test_sources_override_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'group_size = 8\nlr = 0.5\nmode = "async"\n[adapter]\nadapter = "command"\ncommand = "agent {id}"\n'
    )
    config = load_config(path, {"lr": 0.25}, env={"APPLIANCE_GROUP_SIZE": "3", "APPLIANCE_MAX_STEPS": "none"})
    assert config.group_size == 3  # env beats the file
    assert config.lr == 0.25  # overrides beat everything
    assert config.mode == "async"
    assert config.max_steps is None
    assert config.adapter == {"adapter": "command", "command": "agent {id}"}


def test_adapter_from_json_environment() -> None:
    config = load_config(env={"APPLIANCE_ADAPTER": '{"adapter": "python", "agent": "m:f"}'})
    assert config.adapter == {"adapter": "python", "agent": "m:f"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"APPLIANCE_GROUP_SIZE": "many"}, "group_size"),
        ({"APPLIANCE_NO_SUCH_THING": "1"}, "unknown environment setting"),
        ({"APPLIANCE_MODE": "sometimes"}, "mode must be"),
        ({"APPLIANCE_TRAINER": "jax"}, "trainer must be one of"),
        ({"APPLIANCE_ADAPTER": "{not json"}, "adapter"),
        ({"APPLIANCE_CHECKPOINT_EVERY": "-1"}, "checkpoint_every must be 0"),
        ({"APPLIANCE_VALIDATE_EVERY": "-2"}, "validate_every must be 0"),
        ({"APPLIANCE_VALIDATION_TASKS": "0"}, "validation_tasks must be at least 1"),
        ({"APPLIANCE_VALIDATION_TEMPERATURE": "9"}, "validation_temperature must be between"),
    ],
)
def test_bad_settings_are_one_readable_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_secrets_stay_out_of_the_recorded_config() -> None:
    config = load_config(env={"APPLIANCE_ADMIN_TOKEN": "s3cret"})
    assert config.admin_token == "s3cret"
    assert "s3cret" not in str(config.to_json())


def test_export_dir_defaults_into_the_run_directory(tmp_path: Path) -> None:
    config = load_config(overrides={"data_dir": tmp_path / "run"}, env={})
    assert config.export_path == tmp_path / "run" / "export"
    elsewhere = load_config(overrides={"data_dir": tmp_path / "run"}, env={"APPLIANCE_EXPORT_DIR": "/srv/m"})
    assert elsewhere.export_path == Path("/srv/m")


def test_trainer_settings_layer_like_every_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.cli import _config_from, _parser

    path = tmp_path / "run.toml"
    path.write_text('trainer = "verl"\nlora_rank = 8\nparam_dtype = "bf16"\ngradient_checkpointing = true\n')
    config = load_config(
        path,
        {"mini_batches": 2},
        env={"APPLIANCE_TRAINER_RANKS": "2", "APPLIANCE_KL_COEF": "0.05", "APPLIANCE_LORA_RANK": "16"},
    )
    assert (config.trainer, config.lora_rank, config.param_dtype) == (
        "verl",
        16,
        "bf16",
    )  # env beats the file
    assert config.gradient_checkpointing is True
    assert (config.trainer_ranks, config.kl_coef, config.mini_batches) == (2, 0.05, 2)
    assert config.resolved_trainer_ranks() == 2

    # Flags: ``up`` maps each one onto its field and beats the environment; absent flags keep it.
    for key in [k for k in os.environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("APPLIANCE_PUSH_BUCKET_MB", "64")
    monkeypatch.setenv("APPLIANCE_MINI_BATCHES", "3")
    args = _parser().parse_args(
        [
            "up",
            "--config",
            str(path),
            "--trainer-ranks",
            "4",
            "--lora-rank",
            "4",
            "--lora-alpha",
            "32",
            "--no-gradient-checkpointing",
            "--param-dtype",
            "fp32",
            "--kl-coef",
            "0.1",
            "--kl-type",
            "k2",
            "--mini-batches",
            "4",
            "--max-tokens-per-microbatch",
            "1024",
        ]
    )
    flagged = _config_from(args)
    assert flagged.trainer_ranks == 4 and flagged.lora_rank == 4 and flagged.lora_alpha == 32
    assert flagged.gradient_checkpointing is False and flagged.param_dtype == "fp32"
    assert (flagged.kl_coef, flagged.kl_type, flagged.mini_batches) == (0.1, "k2", 4)
    assert flagged.max_tokens_per_microbatch == 1024
    assert flagged.push_bucket_mb == 64  # no flag: the environment's
    cpu = _config_from(
        _parser().parse_args(["up", "--trainer", "verl", "--device", "cpu", "--push-bucket-mb", "8"])
    )
    assert (cpu.trainer, cpu.device, cpu.push_bucket_mb, cpu.mini_batches) == ("verl", "cpu", 8, 3)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"APPLIANCE_TRAINER_RANKS": "0"}, "trainer_ranks must be at least 1"),
        ({"APPLIANCE_TRAINER_RANKS": "2"}, 'trainer_ranks > 1 needs trainer = "verl"'),
        (
            {"APPLIANCE_LORA_RANK": "8", "APPLIANCE_KL_COEF": "0.1"},
            'lora_rank, kl_coef need trainer = "verl"',
        ),
        ({"APPLIANCE_GRADIENT_CHECKPOINTING": "true"}, 'gradient_checkpointing need trainer = "verl"'),
        ({"APPLIANCE_TRAINER": "verl", "APPLIANCE_LORA_RANK": "-1"}, "lora_rank must be 0"),
        ({"APPLIANCE_TRAINER": "verl", "APPLIANCE_MINI_BATCHES": "0"}, "mini_batches must be at least 1"),
        ({"APPLIANCE_TRAINER": "verl", "APPLIANCE_KL_COEF": "-0.1"}, "kl_coef must be 0 or more"),
        ({"APPLIANCE_TRAINER": "verl", "APPLIANCE_PARAM_DTYPE": "int8"}, "param_dtype must be one of"),
        ({"APPLIANCE_MAX_TOKENS_PER_MICROBATCH": "0"}, "max_tokens_per_microbatch must be at least 1"),
        ({"APPLIANCE_PUSH_BUCKET_MB": "0"}, "push_bucket_mb must be at least 1"),
    ],
)
def test_bad_trainer_settings_are_one_readable_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(env=env)
    assert "\n" not in raised.value.message


def test_trainer_options_are_make_trainers_arguments() -> None:
    import inspect

    from trainer.factory import VERL_ONLY_OPTIONS
    from trainer.policy import PolicyTrainer

    torch_options = load_config(
        env={"APPLIANCE_LR": "0.001", "APPLIANCE_TEMPERATURE": "none", "APPLIANCE_DEVICE": "cpu"}
    ).trainer_options()
    assert torch_options == {
        "device": "cpu",
        "lr": 0.001,
        "grad_clip": 1.0,
        "temperature": 1.0,  # None (the client's) trains at 1
        "loss": "ppo",
        "normalization": "rollout",
        "max_tokens_per_microbatch": 4096,
    }
    assert torch_options.keys() <= inspect.signature(PolicyTrainer).parameters.keys()

    verl = load_config(
        env={"APPLIANCE_TRAINER": "verl", "APPLIANCE_LORA_RANK": "8", "APPLIANCE_TRAINER_RANKS": "2"}
    )
    verl_options = verl.trainer_options()
    assert verl_options.keys() - torch_options.keys() == VERL_ONLY_OPTIONS
    assert verl_options["lora_rank"] == 8 and verl_options["lora_alpha"] is None
    assert verl_options["param_dtype"] is None  # the backend picks bf16 on cuda, fp32 on cpu
    assert "trainer_ranks" not in verl_options and "push_bucket_mb" not in verl_options


def test_trainer_ranks_default_to_the_gpus_only_for_verl_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert load_config(env={}).resolved_trainer_ranks() == 1  # cpu
    assert load_config(env={"APPLIANCE_DEVICE": "cuda"}).resolved_trainer_ranks() == 1  # torch backend
    verl = {"APPLIANCE_DEVICE": "cuda", "APPLIANCE_TRAINER": "verl"}
    assert load_config(env=verl).resolved_trainer_ranks() == 4
    assert load_config(env={**verl, "APPLIANCE_TRAINER_RANKS": "2"}).resolved_trainer_ranks() == 2
    assert (
        load_config(
            env={"APPLIANCE_TRAINER": "verl", "APPLIANCE_TRAINER_RANKS": "2"}
        ).resolved_trainer_ranks()
        == 2
    )


def test_device_auto_resolves_once_to_what_torch_sees(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch

    from appliance.app import Appliance
    from appliance.config import ApplianceConfig

    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert ApplianceConfig().device == "auto"
    assert load_config(env={}).device == here  # "cpu" on a machine without a GPU (CI)
    assert load_config(env={"APPLIANCE_DEVICE": "auto"}).to_json()["device"] == here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_config(env={}).device == "cuda"
    assert load_config(env={"APPLIANCE_DEVICE": "cpu"}).device == "cpu"  # an explicit device stays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_config(env={}).device == "cpu"
    assert load_config(env={"APPLIANCE_DEVICE": "cuda:1"}).device == "cuda:1"
    # A config built directly says "auto"; the composition root resolves it before anything
    # reads it (the trainer's options, ApplianceStarted's config).
    appliance = Appliance(ApplianceConfig(data_dir=tmp_path))
    assert appliance.config.device == "cpu"
    assert appliance.config.trainer_options()["device"] == "cpu"
    assert appliance.config.to_json()["device"] == "cpu"


def test_placement_fields_are_checked_like_the_others() -> None:
    config = load_config(
        overrides={"placement": "split", "gpus": 4, "engine_replicas": 2, "tensor_parallel_size": 2}, env={}
    )
    assert (config.placement, config.gpus, config.engine_replicas) == ("split", 4, 2)
    assert load_config(env={}).placement == "collocated" and load_config(env={}).gpus is None
    assert load_config(env={"APPLIANCE_GPUS": "2", "APPLIANCE_ENGINE_REPLICAS": "3"}).engine_replicas == 3
    for env, message in (
        ({"APPLIANCE_PLACEMENT": "sideways"}, "placement must be one of collocated, split"),
        ({"APPLIANCE_GPUS": "0"}, "gpus must be at least 1"),
        ({"APPLIANCE_ENGINE_REPLICAS": "0"}, "engine_replicas must be at least 1"),
        ({"APPLIANCE_TENSOR_PARALLEL_SIZE": "0"}, "tensor_parallel_size must be at least 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(env=env)


def test_up_takes_the_placement_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.cli import _config_from, _parser

    for key in [k for k in os.environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    args = ["--placement", "split", "--gpus", "6", "--engine-replicas", "2", "--tensor-parallel-size", "2"]
    args += ["--max-model-len", "8192", "--sleep-level", "2"]
    config = _config_from(_parser().parse_args(["up", *args]))
    assert (config.placement, config.gpus, config.engine_replicas, config.tensor_parallel_size) == (
        "split",
        6,
        2,
        2,
    )
    assert (config.vllm_max_model_len, config.sleep_level) == (8192, 2)
