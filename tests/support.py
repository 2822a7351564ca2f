"""Helpers shared by tests that run a whole appliance."""

from __future__ import annotations

from pathlib import Path

from appliance.config import ApplianceConfig, load_config


def make_config(tmp_path: Path, model_dir: Path, **overrides: object) -> ApplianceConfig:
    """A small, fast run: tiny model, port 0, two groups of two, short completions."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "run",
        "port": 0,
        "model": str(model_dir),
        "group_size": 2,
        "batch_groups": 2,
        "max_tokens": 8,
    }
    values.update(overrides)
    return load_config(overrides=values, env={})
