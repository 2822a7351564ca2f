"""Where a run's agents run: ``[harness] sandbox`` resolved for the run's adapter, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config import ApplianceConfig, load_config
from appliance.rollouts import sandboxing
from contracts.errors import ConfigError
from harness_adapters import sandbox as sandbox_module

COMMAND = {"adapter": "command", "command": "my-agent {question}"}


def config(tmp_path: Path, **values: object) -> ApplianceConfig:
    return load_config(overrides={"data_dir": tmp_path / "run", **values}, env={})


def test_the_default_in_process_agent_is_said_to_run_unsandboxed(tmp_path: Path) -> None:
    isolation = sandboxing.resolve(config(tmp_path))
    assert isolation.kind == "none" and not isolation.endpoint_sockets
    assert isolation.unsandboxed
    assert isolation.line.startswith("agents run unsandboxed: the python adapter runs agents inside")
    assert 'isolation = "process"' in isolation.line


def test_auto_is_bubblewrap_with_its_limits_and_the_data_directory_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox_module, "bwrap_problem", lambda: None)
    isolation = sandboxing.resolve(config(tmp_path, adapter=COMMAND, sandbox_processes=64))
    assert isolation.kind == "bwrap" and isolation.endpoint_sockets and not isolation.unsandboxed
    assert isolation.adapter_options["sandbox"] == "bwrap"
    assert isolation.adapter_options["sandbox_processes"] == 64
    assert isolation.adapter_options["hidden_paths"] == [(tmp_path / "run").resolve()]
    networked = sandboxing.resolve(config(tmp_path, adapter=COMMAND, allow_network=True))
    assert not networked.endpoint_sockets and "network allowed" in networked.line
    resolved = sandboxing.with_resolved_sandbox(config(tmp_path, adapter=COMMAND), isolation)
    assert resolved.harness.sandbox == "bwrap", "the log records the kind the run used"


def test_auto_without_bubblewrap_refuses_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        sandbox_module, "bwrap_problem", lambda: "bubblewrap is not installed (apt-get install bubblewrap)"
    )
    with pytest.raises(ConfigError) as refused:
        sandboxing.resolve(config(tmp_path, adapter=COMMAND))
    message = str(refused.value)
    assert "\n" not in message
    assert "apt-get install bubblewrap" in message and 'sandbox = "none"' in message
    # Accepted unsandboxed, it says so.
    unsandboxed = sandboxing.resolve(config(tmp_path, adapter=COMMAND, sandbox="none"))
    assert unsandboxed.kind == "none" and unsandboxed.unsandboxed
    assert unsandboxed.line.startswith('agents run unsandboxed (sandbox = "none")')
    # An adapter that starts no process needs no bubblewrap.
    assert sandboxing.resolve(config(tmp_path, adapter={"adapter": "external"})).kind == "none"


def test_a_bad_sandbox_value_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sandbox must be one of auto, bwrap, container, none"):
        config(tmp_path, sandbox="chroot")


def test_the_line_is_read_back_from_a_recorded_config(tmp_path: Path) -> None:
    recorded = config(tmp_path, adapter=COMMAND, sandbox="bwrap").to_json()
    assert (
        sandboxing.recorded_line(recorded)
        == "agents run sandboxed (bwrap; no network but the rollout's endpoint)"
    )
    assert sandboxing.recorded_line({}) is None
