"""A flag for every config field, made from the config's own field list, and ``--help`` grouped
by section.

Owns :func:`add_config_flags`: for each field of ``ApplianceConfig`` and its sections
(``appliance.config.config_keys``) that the parser has no flag for yet, a flag of the field's
user-facing name (``group_size`` -> ``--group-size``; a bool ``--name``/``--no-name``), its
help the first sentence of the field's ``#:`` comment and its default; and of
:func:`group_by_section`: each flag that sets a field moved into an argument group per section
("run" for the run's own fields, then ``[engine]``, ``[trainer]``, ...), in the order of the
fields. A flag written by hand (``--steps`` for ``max_steps``, ``--adapter`` as JSON) is kept as
it is. A generated flag takes the value as text, which ``load_config`` reads into the field's
type as it reads the environment (``none`` for an optional field, names comma-separated).

Fields that are not flags: :data:`NOT_FLAGS`, each with why. It does not own what a field
means nor its checks (``appliance.config``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

from appliance.config import SECTIONS, ApplianceConfig, section_of
from appliance.config.run import KEYS

#: Fields with no flag, and why: set them in a config file or the environment.
NOT_FLAGS = {
    "admin_token": "a secret: a flag's value is visible to every user of the machine (ps); "
    "APPLIANCE_ADMIN_TOKEN, a config file, or <data_dir>/admin_token",
}
#: The title of the run's own fields' group (the top level of a config file).
RUN_GROUP = "run"
_METAVARS = {"int": "N", "float": "X", "Path": "PATH", "tuple": "A,B", "dict": "JSON", "str": "TEXT"}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for each config field ``parser`` has none for (by destination), but
    :data:`NOT_FLAGS`; run after the hand-written flags are added."""
    have = {action.dest for action in parser._actions}
    for name in _field_order():
        if name in have or name in NOT_FLAGS:
            continue
        kind = _kind(name)
        flag = "--" + name.replace("_", "-")
        text = f"{field_help(name)} (default {_default_text(name)})"
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, dest=name, metavar=_METAVARS[kind], help=text)


def group_by_section(parser: argparse.ArgumentParser) -> None:
    """Move each flag of ``parser`` that sets a config field into its section's argument group,
    the groups in the config's order (the run's own first), the flags in the fields' order;
    the rest (``--config``, ``--headless``, ``--help``) stay under "options". A flag is moved
    by its group's list of actions (what ``--help`` reads), which argparse has no call for;
    parsing reads the parser's own list, which is left as it was."""
    groups: dict[str | None, argparse._ArgumentGroup] = {
        None: parser.add_argument_group(RUN_GROUP, "the run's own settings (the top level of a config file)"),
        **{
            section: parser.add_argument_group(f"[{section}]", _first_sentence(cls.__doc__ or ""))
            for section, cls in SECTIONS.items()
        },
    }
    order = {name: index for index, name in enumerate(_field_order())}
    moved = sorted((a for a in parser._actions if a.dest in KEYS), key=lambda a: order[a.dest])
    for action in moved:
        for container in parser._action_groups:
            if action in container._group_actions:
                container._group_actions.remove(action)
        groups[section_of(action.dest)]._group_actions.append(action)


def _field_order() -> list[str]:
    """Every field's user-facing name, as a config file lists them: the run's own, then each
    section's."""
    own = [f.name for f in dataclasses.fields(ApplianceConfig) if f.name not in SECTIONS]
    return own + [name for name in KEYS if KEYS[name][0] is not None]


def _kind(name: str) -> str:
    """The field's type as a name of ``_METAVARS`` or "bool" ("int | None" -> "int")."""
    return str(KEYS[name][1].type).split("|")[0].strip().split("[")[0]


def _default_text(name: str) -> str:
    field = KEYS[name][1]
    value: Any = field.default
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def field_help(name: str) -> str:
    """The first sentence of the ``#:`` comment above the field ``name``; a field declared under
    another's comment (``breaker_backoff_s`` under ``breaker_failures``'s) points to it."""
    comment, owner = _comments().get(name, ("", name))
    if owner != name:
        return f"{name.replace('_', ' ')}: see --{owner.replace('_', '-')}"
    return _first_sentence(comment) or name.replace("_", " ")


@cache
def _comments() -> dict[str, tuple[str, str]]:
    """Each field's ``#:`` comment and the field it was written above (itself, or one before
    it that shares it), read from the sections' source files (a few ms)."""
    out: dict[str, tuple[str, str]] = {}
    attrs = {f.name for f in _all_fields()}
    files = {sys.modules[cls.__module__].__file__ for cls in (ApplianceConfig, *SECTIONS.values())}
    for file in sorted(f for f in files if f):
        comment: list[str] = []
        last = ("", "")
        for line in Path(file).read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("#:"):
                comment.append(stripped[2:].strip())
                continue
            match = re.match(r"\s+(\w+): [^=]+=", line)
            if match and match.group(1) in attrs:
                name = _user_name(match.group(1), file)
                last = (" ".join(comment), name) if comment else last
                out.setdefault(name, last)
            comment = []
    return out


def _all_fields() -> list[dataclasses.Field[Any]]:
    return [field for _, field in KEYS.values()]


def _user_name(attr: str, file: str) -> str:
    """The user-facing name of the attribute ``attr`` declared in ``file`` (``kind`` -> ``engine``)."""
    for name, (section, field) in KEYS.items():
        owner = ApplianceConfig if section is None else SECTIONS[section]
        if field.name == attr and sys.modules[owner.__module__].__file__ == file:
            return name
    return attr


def _first_sentence(text: str) -> str:
    """``text`` up to its first full stop outside parentheses, ``double`` backquotes dropped
    and ``%`` escaped for argparse."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and (index + 1 == len(text) or text[index + 1] == " "):
            text = text[:index]
            break
    text = text.replace("``", "").replace("%", "%%").strip()
    if len(text) > 1 and text[1].islower():  # "Seconds ..." as the written flags say it, not "GPUs"
        text = text[0].lower() + text[1:]
    return text
