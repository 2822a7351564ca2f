"""Typed configuration: defaults, a TOML file, ``APPLIANCE_*`` environment, command-line flags.

Owns ``ApplianceConfig`` and how it is assembled. Later sources override earlier ones:
defaults < ``--config FILE`` (TOML, top-level keys named like the fields) < environment
(``APPLIANCE_<FIELD>``, e.g. ``APPLIANCE_GROUP_SIZE=8``) < explicit flags. The config is passed
explicitly to whoever needs it; nothing reads it from a global.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ConfigError

ENV_PREFIX = "APPLIANCE_"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplianceConfig:
    #: Where the run lives: the event log (events.sqlite), checkpoints, cached models.
    data_dir: Path = Path("appliance-data")
    #: Address the proxy binds to; loopback unless you mean to expose it.
    host: str = "127.0.0.1"
    #: Port of the proxy (0 picks a free one).
    port: int = 8640
    #: Model to serve and train: "tiny" (built offline) or a local Hugging Face model directory.
    model: str = "tiny"
    #: Generation engine: "torch" (in process).
    engine: str = "torch"
    #: Agent to run, as "package.module:function" for the python adapter.
    agent: str = "harness_adapters.examples.arithmetic:agent"
    #: Rollouts per task group (GRPO compares the rollouts of one group).
    group_size: int = 4
    #: Task groups per training step.
    batch_groups: int = 2
    #: Stop when the run reaches this training step (None: until interrupted).
    max_steps: int | None = None
    #: Learning rate of the policy optimizer.
    lr: float = 1e-3
    #: Gradient-norm clip.
    grad_clip: float = 1.0
    #: Sampling temperature forced for training calls (None: what the client asks).
    temperature: float | None = 1.0
    #: Default and maximum completion length per call, in tokens.
    max_tokens: int = 16
    max_tokens_cap: int = 512
    #: Seconds a rollout may run before it is failed.
    rollout_timeout_s: float = 300.0
    #: Concurrent generations the engine batches together.
    max_batch_size: int = 16
    #: Torch CPU threads (None: torch's default). One is fastest for the tiny model on 2 cores.
    threads: int | None = 1
    #: Device for the engine and the trainer ("cpu" or "cuda").
    device: str = "cpu"
    #: Checkpoints to keep on disk.
    keep_checkpoints: int = 3
    #: Seed of the task stream and of the tiny model.
    seed: int = 0
    #: Seconds a call may wait while the machine trains before it gets a retryable 503.
    hold_timeout_s: float = 3600.0
    #: Token for the admin API and the rollout-less /v1 routes (None: generated once into
    #: <data_dir>/admin_token).
    admin_token: str | None = None

    @property
    def db_path(self) -> Path:
        return self.data_dir / "events.sqlite"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    def to_json(self) -> dict[str, Any]:
        """The config as recorded in the event log: secrets left out."""
        out = dataclasses.asdict(self)
        out["data_dir"] = str(self.data_dir)
        out["admin_token"] = "<set>" if self.admin_token else None
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(ApplianceConfig)}


_KINDS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool, "Path": Path}


def _coerce(name: str, value: Any) -> Any:
    """Convert a TOML or environment value to the field's type, with a readable error."""
    annotation = str(_FIELDS[name].type)
    kind = _KINDS[annotation.split("|")[0].strip()]
    if "None" in annotation and (value is None or (isinstance(value, str) and value.lower() in ("none", ""))):
        return None
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if kind is Path:
            return Path(value)
        if isinstance(value, str) and kind is not str:
            return kind(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"config {name!r} must be {annotation}; got {value!r}") from None


def load_config(
    path: Path | None = None, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> ApplianceConfig:
    values: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        for key, value in raw.items():
            if key not in _FIELDS:
                raise ConfigError(
                    f"unknown config key {key!r} in {path}; known: {', '.join(sorted(_FIELDS))}"
                )
            values[key] = _coerce(key, value)
    for key, value in (os.environ if env is None else env).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in _FIELDS:
                raise ConfigError(f"unknown environment setting {key}; known: {', '.join(sorted(_FIELDS))}")
            values[name] = _coerce(name, value)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value)
    config = ApplianceConfig(**values)
    if config.group_size < 1 or config.batch_groups < 1:
        raise ConfigError("group_size and batch_groups must be at least 1")
    return config
