"""Assembling a config from its sources, later ones winning: defaults < a TOML file
(``[section]`` tables or every field flat at the top level) < ``APPLIANCE_<NAME>`` environment
< flags (``load_config``'s ``overrides``). Owns reading each value into its field's type and
refusing, in one line, a key that is unknown, in the wrong section or given twice. It does
not own the fields nor their checks (the sections)."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from appliance.config.run import KEYS, RENAMED, SECTIONS, ApplianceConfig, config_keys, location
from contracts.errors import ConfigError

ENV_PREFIX = "APPLIANCE_"


_KINDS: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "Path": Path,
    "dict": dict,
    "tuple": tuple,
}


def _coerce(name: str, value: Any) -> Any:
    """Convert a TOML or environment value to the type of the field ``name``, with a readable error."""
    annotation = str(KEYS[name][1].type)
    kind = _KINDS[annotation.split("|")[0].strip().split("[")[0]]
    if "None" in annotation and (value is None or (isinstance(value, str) and value.lower() in ("none", ""))):
        return None
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if kind is Path:
            return Path(value)
        if kind is tuple:  # a list of names: a TOML array, or comma-separated in the environment
            if isinstance(value, str):  # spaces after a comma are the writer's, not the names'
                items = [i.strip() for i in value.split(",")] if value.strip() else []
                if not all(items) or (items and value != value.strip()):
                    raise ConfigError(
                        f"{name}: an empty or space-padded name in {value!r} (names, one comma between)"
                    )
            else:
                items = value
            if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
                raise TypeError
            return tuple(items)
        if kind is dict and isinstance(value, str):
            # A bare adapter name (``APPLIANCE_ADAPTER=external``) is that adapter, no options.
            bare = name == "adapter" and not value.lstrip().startswith("{")
            value = {"adapter": value.strip()} if bare else json.loads(value)
        if isinstance(value, str) and kind is not str:
            return kind(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError
        return value
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"config {name!r} must be {annotation}; got {value!r}") from None


def _read(raw: Mapping[str, Any], source: str, *, skip_none: bool = False) -> dict[str, Any]:
    """The fields ``raw`` sets, by user-facing name, coerced: top-level keys by their names and
    tables named like a section (``[scheduler]``) by their fields' names. A key in the wrong
    section, an unknown one, or one set twice (flat and in its section) is a ``ConfigError``."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}

    def put(name: str, spelled: str, value: Any) -> None:
        if skip_none and value is None:
            return
        if name in given:
            raise ConfigError(
                f"config key {name!r} is given twice in {source}: as {given[name]} and {spelled}"
            )
        given[name] = spelled
        values[name] = _coerce(name, value)

    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                put(_in_section(key, sub, source), f"[{key}] {sub}", sub_value)
        else:
            location(key, source)
            put(key, repr(key), value)
    return values


def _in_section(section: str, key: str, source: str) -> str:
    """The user-facing name of ``key`` written in the table ``[section]``: a field of that
    section by its attribute's name (or its user-facing name, ``[trainer] trainer = "verl"``)."""
    for f in dataclasses.fields(SECTIONS[section]):
        if key == f.name:
            return RENAMED.get((section, key), key)
    if key in KEYS and KEYS[key][0] == section:
        return key
    if key in KEYS:
        home = KEYS[key][0]
        where = f"in [{home}]" if home is not None else "at the top level"
        raise ConfigError(f"config key {key!r} belongs {where}, not in [{section}] ({source})")
    known = ", ".join(sorted(f.name for f in dataclasses.fields(SECTIONS[section])))
    raise ConfigError(f"unknown config key {key!r} in [{section}] of {source}; known there: {known}")


def build_config(values: Mapping[str, Any]) -> ApplianceConfig:
    """An ``ApplianceConfig`` from fields by user-facing name (already of their types), each
    section built and checked, then the whole."""
    grouped: dict[str | None, dict[str, Any]] = {}
    for name, value in values.items():
        section, attr = location(name, "config")
        grouped.setdefault(section, {})[attr] = value
    top = grouped.pop(None, {})
    sections = {section: SECTIONS[section](**fields) for section, fields in grouped.items() if section}
    return ApplianceConfig(**top, **sections)


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    resolved: bool = True,
    base: Mapping[str, Any] | None = None,
) -> ApplianceConfig:
    """The config of a run: the defaults, then ``base`` (fields a recorded run gives, flat or
    in sections: ``eval`` takes the run's harness), then ``path`` (TOML, flat keys or
    sections), then the ``APPLIANCE_*`` variables of ``env`` (None: ``os.environ``), then
    ``overrides`` (flags; a None value is a flag not given). ``device`` = "auto" comes back
    resolved (which imports torch) unless ``resolved`` is False: then ``with_resolved_device``
    does it later."""
    values: dict[str, Any] = _read(base or {}, "the run's recorded config")
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        values.update(_read(raw, str(path)))
    for key, value in (os.environ if env is None else env).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in KEYS:
                raise ConfigError(f"unknown environment setting {key}; known: {', '.join(config_keys())}")
            values[name] = _coerce(name, value)
    values.update(_read(overrides or {}, "overrides", skip_none=True))
    config = build_config(values)
    return config.with_resolved_device() if resolved else config
