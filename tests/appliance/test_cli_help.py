"""``up --help``: every flag described, and each flag that sets a config field names the
``APPLIANCE_<NAME>`` variable that sets it too."""

from __future__ import annotations

import argparse
import re

import pytest

from appliance.cli import main
from appliance.cli.entry import _parser
from appliance.config import config_keys, load_config

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
