"""Config assembly: defaults < TOML file (flat or in sections) < APPLIANCE_* environment < explicit
overrides; each section checks itself; the recorded config of either shape is read back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.config import (
    ApplianceConfig,
    EngineConfig,
    HarnessConfig,
    ProxyConfig,
    SchedulerConfig,
    TrainerConfig,
    config_keys,
    load_config,
    recorded_value,
    resolve_engine,
    section_of,
    umask_bits,
)
from appliance.proxy.http import ProxySettings
from appliance.scheduler.decide import SchedulePolicy
from contracts.errors import ConfigError


def test_sources_override_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'group_size = 8\nlr = 0.5\nmode = "async"\n[adapter]\nadapter = "command"\ncommand = "agent {id}"\n'
    )
    config = load_config(path, {"lr": 0.25}, env={"APPLIANCE_GROUP_SIZE": "3", "APPLIANCE_MAX_STEPS": "none"})
    assert config.scheduler.group_size == 3  # env beats the file
    assert config.trainer.lr == 0.25  # overrides beat everything
    assert config.scheduler.mode == "async"
    assert config.scheduler.max_steps is None
    assert config.harness.adapter == {"adapter": "command", "command": "agent {id}"}


def test_the_off_policy_correction_and_lone_rounds_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[trainer]\noff_policy = "bypass"\nis_cap = 1.5\n[scheduler]\nvalidation_holds_admissions = true\n'
    )
    config = load_config(path, env={})
    assert (config.trainer.off_policy, config.trainer.is_cap) == ("bypass", 1.5)
    options = config.trainer.options(device="cpu", temperature=None)
    assert (options["off_policy"], options["is_cap"]) == ("bypass", 1.5)
    policy = SchedulePolicy.from_config(config.scheduler, placement="collocated", held_out=4)
    assert policy.validation_holds_admissions
    assert not load_config(env={}).scheduler.validation_holds_admissions  # off unless asked


def test_names_from_the_environment_may_have_spaces_after_commas() -> None:
    assert load_config(env={"APPLIANCE_SERVED_MODEL_NAMES": "a, b"}).proxy.served_model_names == ("a", "b")
    assert load_config(env={"APPLIANCE_SERVED_MODEL_NAMES": ""}).proxy.served_model_names == ()


def test_adapter_from_json_environment() -> None:
    config = load_config(env={"APPLIANCE_ADAPTER": '{"adapter": "python", "agent": "m:f"}'})
    assert config.harness.adapter == {"adapter": "python", "agent": "m:f"}


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
        ({"APPLIANCE_SERVED_MODEL_NAMES": ",,"}, "served_model_names: an empty or space-padded name"),
        ({"APPLIANCE_SERVED_MODEL_NAMES": " a "}, "served_model_names: an empty or space-padded name"),
        ({"APPLIANCE_SERVED_MODEL_NAMES": "a,,b"}, "served_model_names: an empty or space-padded name"),
        ({"APPLIANCE_SANDBOX": "chroot"}, "sandbox must be one of"),
    ],
)
def test_bad_settings_are_one_readable_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_data_umask_is_octal_and_leaves_the_owner_every_right() -> None:
    assert load_config(env={}).data_umask == "077"
    assert umask_bits(load_config(env={"APPLIANCE_DATA_UMASK": "027"}).data_umask) == 0o027
    for bad, message in (
        ("77", "octal"),
        ("0o77", "octal"),
        ("089", "octal"),
        ("7077", "octal"),
        ("177", "owner"),
    ):
        with pytest.raises(ConfigError, match=f"data_umask.*{message}"):
            load_config(env={"APPLIANCE_DATA_UMASK": bad})


def test_secrets_stay_out_of_the_recorded_config() -> None:
    config = load_config(env={"APPLIANCE_ADMIN_TOKEN": "s3cret"})
    assert config.proxy.admin_token == "s3cret"
    assert "s3cret" not in str(config.to_json())


def test_export_dir_defaults_into_the_run_directory(tmp_path: Path) -> None:
    config = load_config(overrides={"data_dir": tmp_path / "run"}, env={})
    assert config.export_path == tmp_path / "run" / "export"
    elsewhere = load_config(overrides={"data_dir": tmp_path / "run"}, env={"APPLIANCE_EXPORT_DIR": "/srv/m"})
    assert elsewhere.export_path == Path("/srv/m")


def test_trainer_settings_layer_like_every_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.cli.entry import _parser
    from appliance.cli.up import _config_from

    path = tmp_path / "run.toml"
    path.write_text('trainer = "verl"\nlora_rank = 8\nparam_dtype = "bf16"\ngradient_checkpointing = true\n')
    config = load_config(
        path,
        {"mini_batches": 2},
        env={"APPLIANCE_TRAINER_RANKS": "2", "APPLIANCE_KL_COEF": "0.05", "APPLIANCE_LORA_RANK": "16"},
    )
    trainer = config.trainer
    assert (trainer.backend, trainer.lora_rank, trainer.param_dtype) == (
        "verl",
        16,
        "bf16",
    )  # env beats the file
    assert trainer.gradient_checkpointing is True
    assert (trainer.trainer_ranks, trainer.kl_coef, trainer.mini_batches) == (2, 0.05, 2)
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
    flagged = _config_from(args).trainer
    assert flagged.trainer_ranks == 4 and flagged.lora_rank == 4 and flagged.lora_alpha == 32
    assert flagged.gradient_checkpointing is False and flagged.param_dtype == "fp32"
    assert (flagged.kl_coef, flagged.kl_type, flagged.mini_batches) == (0.1, "k2", 4)
    assert flagged.max_tokens_per_microbatch == 1024
    assert flagged.push_bucket_mb == 64  # no flag: the environment's
    cpu = _config_from(
        _parser().parse_args(["up", "--trainer", "verl", "--device", "cpu", "--push-bucket-mb", "8"])
    )
    assert (cpu.trainer.backend, cpu.device, cpu.trainer.push_bucket_mb, cpu.trainer.mini_batches) == (
        "verl",
        "cpu",
        8,
        3,
    )


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
        ({"APPLIANCE_OFF_POLICY": "sometimes"}, "off_policy must be one of"),
        ({"APPLIANCE_IS_CAP": "0.5"}, "is_cap must be at least 1"),
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

    config = load_config(
        env={"APPLIANCE_LR": "0.001", "APPLIANCE_TEMPERATURE": "none", "APPLIANCE_DEVICE": "cpu"}
    )
    torch_options = config.trainer.options(device=config.device, temperature=config.proxy.temperature)
    assert torch_options == {
        "device": "cpu",
        "lr": 0.001,
        "grad_clip": 1.0,
        "temperature": 1.0,  # None (the client's) trains at 1
        "loss": "ppo",
        # Both backends correct stale tokens the same way unless the config says otherwise.
        "off_policy": "decoupled",
        "is_cap": 2.0,
        "normalization": "rollout",
        "max_tokens_per_microbatch": 4096,
    }
    assert torch_options.keys() <= inspect.signature(PolicyTrainer).parameters.keys()

    verl = load_config(
        env={"APPLIANCE_TRAINER": "verl", "APPLIANCE_LORA_RANK": "8", "APPLIANCE_TRAINER_RANKS": "2"}
    )
    verl_options = verl.trainer.options(device=verl.device, temperature=verl.proxy.temperature)
    assert verl_options.keys() - torch_options.keys() == VERL_ONLY_OPTIONS
    assert verl_options["lora_rank"] == 8 and verl_options["lora_alpha"] is None
    # Decided by the config (bf16 on cuda, fp32 on cpu), which gives vLLM the same one.
    assert verl_options["param_dtype"] == ("bf16" if verl.device.startswith("cuda") else "fp32")
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
    assert (
        appliance.config.trainer.options(device=appliance.config.device, temperature=1.0)["device"] == "cpu"
    )
    assert appliance.config.to_json()["device"] == "cpu"


def test_placement_fields_are_checked_like_the_others() -> None:
    config = load_config(
        overrides={"placement": "split", "gpus": 4, "engine_replicas": 2, "tensor_parallel_size": 2}, env={}
    )
    assert (config.placement, config.gpus, config.engine.engine_replicas) == ("split", 4, 2)
    assert load_config(env={}).placement == "collocated" and load_config(env={}).gpus is None
    assert (
        load_config(env={"APPLIANCE_GPUS": "2", "APPLIANCE_ENGINE_REPLICAS": "3"}).engine.engine_replicas == 3
    )
    for env, message in (
        ({"APPLIANCE_PLACEMENT": "sideways"}, "placement must be one of collocated, split"),
        ({"APPLIANCE_GPUS": "0"}, "gpus must be at least 1"),
        ({"APPLIANCE_ENGINE_REPLICAS": "0"}, "engine_replicas must be at least 1"),
        ({"APPLIANCE_TENSOR_PARALLEL_SIZE": "0"}, "tensor_parallel_size must be at least 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(env=env)


def test_up_takes_the_placement_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.cli.entry import _parser
    from appliance.cli.up import _config_from

    for key in [k for k in os.environ if k.startswith("APPLIANCE_")]:
        monkeypatch.delenv(key)
    args = ["--placement", "split", "--gpus", "6", "--engine-replicas", "2", "--tensor-parallel-size", "2"]
    args += ["--max-model-len", "8192", "--sleep-level", "2"]
    config = _config_from(_parser().parse_args(["up", *args]))
    engine = config.engine
    assert (config.placement, config.gpus, engine.engine_replicas, engine.tensor_parallel_size) == (
        "split",
        6,
        2,
        2,
    )
    assert (engine.vllm_max_model_len, config.scheduler.sleep_level) == (8192, 2)
    more = ["--mode", "async", "--eta", "2", "--enforce-eager", "--push-transport", "files"]
    config = _config_from(_parser().parse_args(["up", *more]))
    assert (config.scheduler.mode, config.scheduler.eta) == ("async", 2)
    assert (config.engine.enforce_eager, config.trainer.push_transport) == (True, "files")
    assert _config_from(_parser().parse_args(["up"])).engine.enforce_eager is None


# --- sections ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        (EngineConfig, {"kind": "tensorrt"}, "engine must be one of auto, torch, vllm; got 'tensorrt'"),
        (EngineConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be above 0"),
        (EngineConfig, {"vllm_url": "http://h:1", "engine_replicas": 2}, "vllm_url attaches to one"),
        (TrainerConfig, {"backend": "jax"}, "trainer must be one of torch, verl"),
        (TrainerConfig, {"keep_checkpoints": 0}, "keep_checkpoints must be at least 1; got 0"),
        (TrainerConfig, {"lora_rank": 8}, 'lora_rank need trainer = "verl"'),
        (SchedulerConfig, {"group_size": 0}, "group_size must be at least 1; got 0"),
        (
            SchedulerConfig,
            {"max_inflight_rollouts": 2},
            r"max_inflight_rollouts \(2\) must be at least group_size",
        ),
        (SchedulerConfig, {"breaker_backoff_max_s": 1.0}, r"breaker_backoff_max_s \(1.0\) must be at least"),
        (ProxyConfig, {"max_body_bytes": 0}, "max_body_bytes must be at least 1; got 0"),
        (
            ProxyConfig,
            {"hold_timeout_s": float("inf")},
            "hold_timeout_s must be a positive number of seconds",
        ),
        (HarnessConfig, {"validation_fraction": 1.0}, r"validation_fraction must be in \[0, 1\)"),
        (HarnessConfig, {"infra_retries": -1}, "infra_retries must be at least 0; got -1"),
    ],
)
def test_each_section_checks_its_own_fields(section: type, values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        section(**values)
    assert "\n" not in raised.value.message
    section()  # the defaults are valid


def test_the_run_checks_its_own_fields() -> None:
    with pytest.raises(ConfigError, match="placement must be one of collocated, split; got 'sideways'"):
        ApplianceConfig(placement="sideways")
    with pytest.raises(ConfigError, match="stop_timeout_s must be a positive number of seconds"):
        ApplianceConfig(stop_timeout_s=0.0)


SECTIONED = """
data_dir = "run"
model = "tiny"
seed = 3

[engine]
kind = "vllm"
max_batch_size = 32
vllm_max_model_len = 2048

[trainer]
backend = "verl"
lora_rank = 8
lr = 0.0002
export_dir = "/srv/model"

[scheduler]
mode = "async"
group_size = 8
batch_groups = 4
validate_every = 0

[proxy]
port = 0
max_tokens = 64
temperature = "none"

[harness]
task_split = "train"
rollout_timeout_s = 60.0

[harness.adapter]
adapter = "command"
command = "agent {id}"
"""

FLAT = """
data_dir = "run"
model = "tiny"
seed = 3
engine = "vllm"
max_batch_size = 32
vllm_max_model_len = 2048
trainer = "verl"
lora_rank = 8
lr = 0.0002
export_dir = "/srv/model"
mode = "async"
group_size = 8
batch_groups = 4
validate_every = 0
port = 0
max_tokens = 64
temperature = "none"
task_split = "train"
rollout_timeout_s = 60.0

[adapter]
adapter = "command"
command = "agent {id}"
"""


def test_flat_and_sectioned_files_give_the_same_config(tmp_path: Path) -> None:
    sectioned, flat = tmp_path / "sectioned.toml", tmp_path / "flat.toml"
    sectioned.write_text(SECTIONED)
    flat.write_text(FLAT)
    config = load_config(sectioned, env={})
    assert config == load_config(flat, env={})
    assert (config.engine.kind, config.engine.max_batch_size, config.engine.vllm_max_model_len) == (
        "vllm",
        32,
        2048,
    )
    assert (config.trainer.backend, config.trainer.lora_rank, config.trainer.export_dir) == (
        "verl",
        8,
        Path("/srv/model"),
    )
    assert (config.scheduler.mode, config.scheduler.group_size, config.scheduler.batch_groups) == (
        "async",
        8,
        4,
    )
    assert (config.proxy.port, config.proxy.max_tokens, config.proxy.temperature) == (0, 64, None)
    assert config.harness.adapter == {"adapter": "command", "command": "agent {id}"}
    assert config.export_path == Path("/srv/model")
    # A mix of both works too, and the backends may be named by their flat names in their section.
    mixed = tmp_path / "mixed.toml"
    mixed.write_text(
        'engine = "vllm"\ngroup_size = 8\n[trainer]\ntrainer = "verl"\n[scheduler]\nbatch_groups = 4\n'
    )
    both = load_config(mixed, env={})
    assert (
        both.engine.kind,
        both.trainer.backend,
        both.scheduler.group_size,
        both.scheduler.batch_groups,
    ) == (
        "vllm",
        "verl",
        8,
        4,
    )
    # Overrides take sections too.
    assert load_config(overrides={"scheduler": {"group_size": 5}}, env={}).scheduler.group_size == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[engine]\ngroup_size = 8\n",
            r"config key 'group_size' belongs in \[scheduler\], not in \[engine\]",
        ),
        ("[proxy]\ndata_dir = 'x'\n", r"config key 'data_dir' belongs at the top level, not in \[proxy\]"),
        ("[trainer]\nlearning_rate = 0.1\n", r"unknown config key 'learning_rate' in \[trainer\]"),
        ("no_such_key = 1\n", "unknown config key 'no_such_key'"),
        ("kind = 'vllm'\n", r"unknown config key 'kind' .*\(it belongs in \[engine\]\)"),
        ("group_size = 8\n[scheduler]\ngroup_size = 4\n", "config key 'group_size' is given twice"),
        # TOML itself refuses a key that is both a value and a table.
        ("engine = 'vllm'\n[engine]\nkind = 'torch'\n", "cannot read config file .*Cannot overwrite"),
        ("[trainer]\nbackend = 'verl'\ntrainer = 'verl'\n", "config key 'trainer' is given twice"),
        ("[scheduler]\ngroup_size = 'many'\n", "config 'group_size' must be int"),
        ("[scheduler]\ngroup_size = 0\n", "group_size must be at least 1; got 0"),
    ],
)
def test_a_key_in_the_wrong_place_unknown_or_given_twice_is_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(path, env={})
    assert "\n" not in raised.value.message


def test_every_field_has_one_name_and_an_environment_variable() -> None:
    keys = config_keys()
    assert len(keys) == len(set(keys)) and {"engine", "trainer", "group_size", "data_dir"} <= set(keys)
    assert "kind" not in keys and "backend" not in keys  # the backends keep their flat names
    env = {
        "APPLIANCE_GROUP_SIZE": "8",
        "APPLIANCE_ENGINE": "vllm",
        "APPLIANCE_TRAINER": "verl",
        "APPLIANCE_VLLM_PORT": "9000",
        "APPLIANCE_KL_COEF": "0.1",
        "APPLIANCE_MAX_QUEUED_CALLS": "7",
        "APPLIANCE_INFRA_RETRIES": "0",
        "APPLIANCE_SEED": "9",
    }
    config = load_config(env=env)
    assert (config.scheduler.group_size, config.engine.kind, config.engine.vllm_port) == (8, "vllm", 9000)
    assert (config.trainer.backend, config.trainer.kl_coef) == ("verl", 0.1)
    assert (config.proxy.max_queued_calls, config.harness.infra_retries, config.seed) == (7, 0, 9)
    assert section_of("group_size") == "scheduler" and section_of("engine") == "engine"
    assert section_of("seed") is None


def test_replace_takes_the_flat_names_and_checks_again() -> None:
    config = load_config(env={})
    changed = config.replace(engine="vllm", trainer="verl", lora_rank=16, group_size=3, port=0, seed=2)
    assert (changed.engine.kind, changed.trainer.backend, changed.trainer.lora_rank) == ("vllm", "verl", 16)
    assert (changed.scheduler.group_size, changed.proxy.port, changed.seed) == (3, 0, 2)
    assert changed.scheduler.batch_groups == config.scheduler.batch_groups  # the rest stays
    with pytest.raises(ConfigError, match='lora_rank need trainer = "verl"'):
        config.replace(lora_rank=16)
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        config.replace(learning_rate=0.1)


def _old_policy(config: ApplianceConfig, held_out: int) -> SchedulePolicy:
    """What ``Appliance`` built field by field before the sections (the reference)."""
    s = config.scheduler
    return SchedulePolicy(
        batch_groups=s.batch_groups,
        group_size=s.group_size,
        max_steps=s.max_steps,
        mode="split" if config.placement == "split" else ("async" if s.mode == "async" else "sync"),
        eta=s.eta if s.mode == "async" else 0,
        max_inflight_rollouts=s.max_inflight_rollouts,
        min_generate_s=s.min_generate_s,
        validate_every=s.validate_every if held_out else 0,
        validation_tasks=max(1, held_out),
        validation_holds_admissions=s.validation_holds_admissions,
        breaker_failures=s.breaker_failures,
        breaker_max_trips=s.breaker_max_trips,
    )


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"APPLIANCE_MODE": "async", "APPLIANCE_ETA": "3", "APPLIANCE_MIN_GENERATE_S": "2.5"},
        {"APPLIANCE_PLACEMENT": "split", "APPLIANCE_MODE": "sync", "APPLIANCE_MAX_STEPS": "7"},
        {"APPLIANCE_PLACEMENT": "split", "APPLIANCE_MODE": "async", "APPLIANCE_MAX_INFLIGHT_ROLLOUTS": "8"},
        {"APPLIANCE_VALIDATE_EVERY": "0", "APPLIANCE_BREAKER_FAILURES": "0", "APPLIANCE_GROUP_SIZE": "1"},
        {"APPLIANCE_MODE": "async", "APPLIANCE_VALIDATION_HOLDS_ADMISSIONS": "true"},
    ],
)
def test_the_components_settings_built_from_their_sections(env: dict[str, str]) -> None:
    config = load_config(env=env)
    for held_out in (0, 1, 8):
        assert SchedulePolicy.from_config(
            config.scheduler, placement=config.placement, held_out=held_out
        ) == _old_policy(config, held_out)
    proxy = config.proxy
    assert ProxySettings.from_config(proxy, model_name="tiny", admin_token="t") == ProxySettings(
        model_name="tiny",
        max_tokens_default=proxy.max_tokens,
        max_tokens_cap=proxy.max_tokens_cap,
        temperature_override=proxy.temperature,
        admin_token="t",
        max_body_bytes=proxy.max_body_bytes,
        max_queued_calls=proxy.max_queued_calls,
    )


def test_the_recorded_config_is_nested_and_both_shapes_are_read() -> None:
    config = load_config(env={"APPLIANCE_EXPORT_DIR": "/srv/m", "APPLIANCE_ADMIN_TOKEN": "s3cret"})
    recorded = config.to_json()
    assert recorded["scheduler"]["group_size"] == 4 and recorded["engine"]["kind"] == "torch"
    assert recorded["proxy"]["admin_token"] == "<set>" and recorded["model"] == "smollm2-135m"
    flat = {"model": "tiny", "engine": "vllm", "trainer": "verl", "group_size": 8, "export_dir": "/old"}
    for name, nested, old in (
        ("export_dir", "/srv/m", "/old"),
        ("engine", "torch", "vllm"),
        ("trainer", "torch", "verl"),
        ("group_size", 4, 8),
        ("model", "smollm2-135m", "tiny"),
    ):
        assert recorded_value(recorded, name) == nested
        assert recorded_value(flat, name) == old
    assert recorded_value({}, "export_dir") is None


def test_the_push_transport_follows_the_placement_unless_named(tmp_path: Path) -> None:
    """auto: over a weight group (NCCL) with split placement on GPUs, files otherwise; "group"
    names gloo on CPU; it needs vLLM and verl."""

    def backend(**values: object) -> str | None:
        return load_config(overrides={"data_dir": tmp_path, **values}, env={}).weight_group_backend()

    gpu_split = {"device": "cuda", "placement": "split", "engine": "vllm", "trainer": "verl"}
    assert backend(**gpu_split) == "nccl"
    assert backend(**{**gpu_split, "placement": "collocated"}) is None
    assert backend(**{**gpu_split, "push_transport": "files"}) is None
    assert backend(device="cpu", engine="vllm", trainer="verl") is None
    assert backend(device="cpu", engine="vllm", trainer="verl", push_transport="group") == "gloo"
    with pytest.raises(ConfigError, match='push_transport = "group" needs engine = "vllm"'):
        backend(device="cpu", push_transport="group")
    with pytest.raises(ConfigError, match="push_transport"):
        backend(push_transport="ipc")
    assert load_config(overrides={"push_transport": "files"}, env={}).trainer.push_transport == "files"


def test_a_weight_group_on_collocated_gpus_is_refused_once_the_device_is_known(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Collocated, the trainer's rank 0 and a vLLM worker share each GPU: NCCL refuses two ranks
    on one GPU, so "group" is refused with one line naming the placement, as the config is built
    (cuda) or as "auto" resolves to cuda; on CPU (gloo) and split it stands."""
    import torch

    group = {"data_dir": tmp_path, "engine": "vllm", "trainer": "verl", "push_transport": "group"}
    refused = 'push_transport = "group" cannot be used with placement = "collocated" on cuda'
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=refused) as raised:
            load_config(overrides={**group, "device": device, "placement": "collocated"}, env={})
        assert "\n" not in raised.value.message and "--placement split" in raised.value.message
    with pytest.raises(ConfigError, match=refused):  # built directly, before any look at the machine
        ApplianceConfig(device="cuda", trainer=TrainerConfig(backend="verl", push_transport="group"))
    split = load_config(overrides={**group, "device": "cuda", "placement": "split"}, env={})
    assert split.weight_group_backend() == "nccl"
    assert load_config(overrides={**group, "device": "cpu"}, env={}).weight_group_backend() == "gloo"

    # "auto": the device is known when it resolves (with_resolved_device), and checked then.
    auto = ApplianceConfig(
        device="auto",
        engine=EngineConfig(kind="vllm"),
        trainer=TrainerConfig(backend="verl", push_transport="group"),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=refused):
        auto.with_resolved_device()
    with pytest.raises(ConfigError, match=refused):
        load_config(overrides=group, env={})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto.with_resolved_device().weight_group_backend() == "gloo"


def test_the_engine_auto_is_vllm_on_gpus_where_its_venv_exists(tmp_path: Path) -> None:
    venv_python = tmp_path / "venv" / "bin" / "python"
    assert resolve_engine("cpu", venv_python) == "torch"
    assert resolve_engine("cuda", venv_python) == "torch"  # no venv (yet)
    venv_python.parent.mkdir(parents=True)
    venv_python.touch()
    assert resolve_engine("cuda", venv_python) == "vllm"
    assert resolve_engine("cpu", venv_python) == "torch"
    # Resolved once with the device: nothing downstream sees "auto".
    config = load_config(overrides={"device": "cpu"}, env={})
    assert config.engine.kind == "torch"
    gpu = ApplianceConfig(device="cuda", engine=EngineConfig(vllm_python=venv_python)).with_resolved_device()
    assert gpu.engine.kind == "vllm"
    assert (
        ApplianceConfig(device="cuda").replace(engine="torch").with_resolved_device().engine.kind == "torch"
    )
