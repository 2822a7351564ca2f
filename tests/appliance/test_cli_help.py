"""``up --help``: every flag described, and each flag that sets a config field names the
``APPLIANCE_<NAME>`` variable that sets it too; every config field is a flag of ``up`` that sets
it (but those named, and why, in the README), listed under its section's heading."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from appliance.cli import config_flags, main
from appliance.cli.entry import _parser
from appliance.cli.up import _config_from
from appliance.config import VERL_ONLY, ApplianceConfig, config_keys, load_config, recorded_value, section_of
from appliance.config.run import KEYS

ROOT = Path(__file__).resolve().parents[2]
ENV_NOTE = re.compile(r" \(env (APPLIANCE_[A-Z0-9_]+)\)$")


def up_parser() -> argparse.ArgumentParser:
    parser = _parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    up = sub.choices["up"]
    assert isinstance(up, argparse.ArgumentParser)
    return up


def test_every_up_flag_is_described_and_names_its_variable() -> None:
    keys = set(config_keys())
    flags = [a for a in up_parser()._actions if a.option_strings]
    assert len(flags) > 30
    backed = 0
    for action in flags:
        name = action.option_strings[-1]
        note = ENV_NOTE.search(action.help or "")
        described = ENV_NOTE.sub("", action.help or "").strip()
        assert described, f"{name} has no description"
        if action.dest in keys:
            backed += 1
            assert note is not None, f"{name} sets the config field {action.dest} but names no variable"
            assert note.group(1) == f"APPLIANCE_{action.dest.upper()}"
        else:
            assert note is None, f"{name} sets no config field, yet names {note and note.group(1)}"
    assert backed >= len(flags) - 4  # all but --help, --config, --headless, --verbose


def test_the_named_variables_are_the_ones_the_config_reads() -> None:
    by_flag = {a.option_strings[-1]: a.help or "" for a in up_parser()._actions if a.option_strings}
    # --steps sets max_steps: the variable follows the field, not the flag's spelling.
    assert by_flag["--steps"].endswith("(env APPLIANCE_MAX_STEPS)")
    assert load_config(env={"APPLIANCE_MAX_STEPS": "7"}).scheduler.max_steps == 7
    assert by_flag["--max-model-len"].endswith("(env APPLIANCE_VLLM_MAX_MODEL_LEN)")
    assert load_config(env={"APPLIANCE_VLLM_MAX_MODEL_LEN": "512"}).engine.vllm_max_model_len == 512


def test_up_help_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for variable in ("APPLIANCE_GROUP_SIZE", "APPLIANCE_DATA_DIR", "APPLIANCE_MAX_STEPS", "APPLIANCE_LR"):
        assert f"(env {variable})" in out


@pytest.mark.parametrize("command", ["up", "eval"])
def test_the_engine_flag_names_its_default(command: str) -> None:
    parser = _parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    (engine,) = (a for a in sub.choices[command]._actions if "--engine" in a.option_strings)
    assert "auto (default" in (engine.help or ""), engine.help
    assert load_config(env={}, resolved=False).engine.kind == "auto"


# --- every config field is a flag ------------------------------------------------------------------

#: The fields that are not flags of ``up`` (README, "Configuration"), each set otherwise.
NOT_FLAGS = {"admin_token"}
#: A value each field may take, where "one more than the default" would not do, as given on the
#: command line; and the flags that value needs beside it.
VALUES: dict[str, str] = {
    "data_dir": "/tmp/run",
    "model": "tiny",
    "device": "cpu",
    "placement": "split",
    "data_umask": "027",
    "engine": "torch",
    "trainer": "verl",
    "advantage": "rloo",
    "normalization": "token",
    "loss": "gspo",
    "off_policy": "bypass",
    "push_transport": "files",
    "param_dtype": "fp16",
    "kl_type": "kl",
    "mode": "async",
    "stale_tokens": "reweight",
    "max_inflight_rollouts": "8",
    "sleep_level": "2",
    "agent": "my_package.agent:run",
    "adapter": '{"adapter": "command", "command": "my-agent {prompt}"}',
    "sandbox": "none",
    "host": "0.0.0.0",
    "vllm_url": "http://127.0.0.1:8000",
    "remote": "http://10.0.0.2:8000,http://10.0.0.3:8000",
    "remote_weights": "shm",
    "weights_url": "http://10.0.0.1:8640",
    "loggers": "console,tensorboard",
    "served_model_names": "gpt-4o-mini,claude-sonnet-4-5",
}
NEEDS = {name: {"trainer": "verl"} for name in ("trainer_ranks", *VERL_ONLY)}


def another_value(name: str) -> str:
    """A value of the field ``name`` other than its default, as a flag takes it."""
    if name in VALUES:
        return VALUES[name]
    default = getattr(ApplianceConfig(), name, None)
    section = section_of(name)
    if section is not None:
        default = getattr(getattr(ApplianceConfig(), section), KEYS[name][1].name)
    kind = str(KEYS[name][1].type)
    if kind.startswith("bool"):
        return "off" if default else "on"
    if kind.startswith("int"):
        return str((default or 1) + 1)
    if kind.startswith("float"):
        return str(default * 2 if default else 0.5)
    if kind.startswith("Path"):
        return f"/tmp/{name}"
    return f"{name}-value"


def test_every_config_field_is_a_flag_of_up_that_sets_it() -> None:
    flags = {a.dest: a for a in up_parser()._actions if a.option_strings}
    missing = set(config_keys()) - set(flags) - NOT_FLAGS
    assert not missing, f"config fields without a flag of up: {sorted(missing)}"
    assert not NOT_FLAGS & set(flags)
    for name in config_keys():
        if name in NOT_FLAGS:
            continue
        action, value = flags[name], another_value(name)
        flag = action.option_strings[0]
        if value in ("on", "off"):  # --name / --no-name
            argv, expected = ([flag] if value == "on" else [f"--no-{flag[2:]}"]), value == "on"
        else:
            argv, expected = [flag, value], None
        needs = NEEDS.get(name, {})
        beside = [part for key, given in needs.items() for part in (f"--{key}", given)]
        config = _config_from(_parser().parse_args(["up", *beside, *argv]), resolved=False)
        if expected is None:  # the value as the environment's APPLIANCE_<NAME> would set it
            env = {f"APPLIANCE_{key.upper()}": given for key, given in {**needs, name: value}.items()}
            expected = recorded_value(load_config(env=env, resolved=False).to_json(), name)
        got = recorded_value(config.to_json(), name)
        assert got == expected, f"{flag} {value}: {name} is {got!r}"
        assert got != recorded_value(ApplianceConfig().to_json(), name), f"{flag} left {name} at its default"


def test_up_help_is_grouped_by_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    out = capsys.readouterr().out
    headings = [line.rstrip(":") for line in out.splitlines() if line and not line[0].isspace()]
    assert headings[1:] == [
        "options",
        "run",
        "[engine]",
        "[trainer]",
        "[scheduler]",
        "[proxy]",
        "[harness]",
        "[tracking]",
    ]

    def section(title: str) -> str:
        start = out.index(f"\n{title}:\n")
        return out[start : out.find("\n\n[", start + 1)]

    # Written flags and generated ones alike, each under its section's heading.
    for title, flag in [
        ("run", "--data-dir"),
        ("run", "--seed"),
        ("[engine]", "--max-model-len"),
        ("[trainer]", "--lora-rank"),
        ("[scheduler]", "--steps"),
        ("[scheduler]", "--validate-every"),
        ("[scheduler]", "--breaker-max-trips"),
        ("[proxy]", "--metrics-public"),
        ("[proxy]", "--served-model-names"),
        ("[harness]", "--adapter"),
        ("[tracking]", "--loggers"),
    ]:
        assert f"  {flag} " in section(title) or f"  {flag}," in section(title), (title, flag)
    assert "  --headless " in section("options") and "--admin-token" not in out


def test_the_fields_that_are_not_flags_are_named_in_the_readme() -> None:
    assert set(config_flags.NOT_FLAGS) == NOT_FLAGS
    readme = " ".join((ROOT / "README.md").read_text().split())
    for name in NOT_FLAGS:
        assert f"One field is not a flag: `{name}`" in readme
