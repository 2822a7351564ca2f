"""Typed configuration: defaults, a TOML file, ``APPLIANCE_*`` environment, command-line flags.

Owns ``ApplianceConfig`` and how it is assembled. The config is the run's own settings (data
directory, model, device, seed, placement, ...) plus one section per component, each a frozen
dataclass in its own module that checks its own fields when it is built: ``engine``
(``EngineConfig``), ``trainer`` (``TrainerConfig``), ``scheduler`` (``SchedulerConfig``),
``proxy`` (``ProxyConfig``), ``harness`` (``HarnessConfig``) and ``tracking``
(``TrackingConfig``). The components take their section directly
(``SchedulePolicy.from_config``, ``ProxySettings.from_config``, ``TrainerConfig.options``,
``create_engine`` reads ``config.engine``, the rollout controller ``config.harness``); checks that
span sections are ``ApplianceConfig``'s (``run``). A bad value is a ``ConfigError`` of one line
naming it (``checks``).

Every field has one user-facing name, unique across sections (the attribute's name, except the
backends: ``engine`` is ``config.engine.kind``, ``trainer`` is ``config.trainer.backend``).
Later sources override earlier ones (``load``): defaults < ``--config FILE`` < environment
(``APPLIANCE_<NAME>``, e.g. ``APPLIANCE_GROUP_SIZE=8``) < explicit flags (``load_config``'s
``overrides``). A TOML file names a field either in its section (``[scheduler]`` then
``group_size = 8``) or at the top level by its name (``group_size = 8``, the flat form of
earlier versions); a key in the wrong section, an unknown one, or one given both ways is refused.
The config is passed explicitly to whoever needs it; nothing reads it from a global. It does
not own what the components do with their settings, nor the checks that need the machine
(``appliance.operations.preflight``). It imports nothing of the appliance's at import time
(only ``contracts``), so a bad config is refused before torch or an engine is loaded.

This module is the package's public face: import config names from ``appliance.config``.
"""

from appliance.config.checks import umask_bits
from appliance.config.engine import ENGINES, EngineConfig
from appliance.config.harness import HarnessConfig
from appliance.config.load import ENV_PREFIX, build_config, load_config
from appliance.config.proxy import ProxyConfig
from appliance.config.run import (
    PLACEMENTS,
    SECTIONS,
    ApplianceConfig,
    config_keys,
    recorded_value,
    resolve_device,
    resolve_engine,
    section_of,
)
from appliance.config.scheduler import ScheduleKnobs, SchedulerConfig
from appliance.config.tracking import LOGGERS, TrackingConfig
from appliance.config.trainer import (
    PARAM_DTYPES,
    PUSH_TRANSPORTS,
    TORCH_DTYPES,
    TRAINERS,
    VERL_ONLY,
    TrainerConfig,
)

__all__ = [
    "ENGINES",
    "ENV_PREFIX",
    "LOGGERS",
    "PARAM_DTYPES",
    "PLACEMENTS",
    "PUSH_TRANSPORTS",
    "SECTIONS",
    "TORCH_DTYPES",
    "TRAINERS",
    "VERL_ONLY",
    "ApplianceConfig",
    "EngineConfig",
    "HarnessConfig",
    "ProxyConfig",
    "ScheduleKnobs",
    "SchedulerConfig",
    "TrackingConfig",
    "TrainerConfig",
    "build_config",
    "config_keys",
    "load_config",
    "recorded_value",
    "resolve_device",
    "resolve_engine",
    "section_of",
    "umask_bits",
]
