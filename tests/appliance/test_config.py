"""Config assembly: defaults < TOML file < APPLIANCE_* environment < explicit overrides."""

from __future__ import annotations

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
