"""Command templates and task variables: task data into an argv and an environment, safely.

Owns how a command template (``"my-agent --repo {repo} --task {problem_statement}"``) becomes
an argv, and how a task becomes ``TASK_*`` environment variables. Used by the ``command``,
``mini-swe-agent`` and ``kubernetes`` adapters.

Safety: a template string is split into arguments once, the way a shell would split it
(``shlex.split``), and each placeholder is then replaced inside its own argument. The argv is
executed directly, never by a shell, so a task field can never become two arguments or run a
command. The one way to undo that, a template that hands a placeholder to an interpreter as
code (``sh -c "... {field}"``, ``python -c ...``), is refused: such scripts should read
``"$TASK_FIELD"`` from their environment instead.

Placeholders are plain names (``{repo}``, no attribute or index access, no conversions); the
values are the task's top-level fields (strings as they are, anything else as JSON) and the
built-ins ``task_id``, ``rollout_id``, ``model``, ``base_url``, ``reward_url``, ``workdir``,
``rollout_dir`` and ``task_json``, which win over task fields of the same name. ``{{`` and
``}}`` are literal braces. A missing field is a ``ConfigError``.
"""

from __future__ import annotations

import json
import re
import shlex
import string
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from contracts.errors import ConfigError
from harness_adapters.base import Task

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Interpreters and the option after which an argument is code, not data.
_INLINE_CODE = {"sh": "-c", "bash": "-c", "dash": "-c", "zsh": "-c", "ksh": "-c", "fish": "-c"}
_INLINE_CODE_PREFIX = {"python": "-c", "perl": "-e", "node": "-e", "ruby": "-e", "pwsh": "-c"}
#: Task fields longer than this are left out of the environment (``TASK_JSON`` has them all):
#: one environment string may not exceed 128 KiB on Linux.
MAX_ENV_VALUE = 32 * 1024


def split_command(command: str | list[str]) -> list[str]:
    """A template as a list of argument templates (a string is split like a shell would)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv:
        raise ConfigError("the command is empty")
    for arg in argv:
        placeholders(arg)
    _refuse_inline_code(argv)
    return argv


def placeholders(template: str) -> list[str]:
    """The field names a template uses; ``ConfigError`` for anything but plain ``{name}``."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"bad template {template!r}: {exc}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not _NAME.match(name) or spec or conversion:
            raise ConfigError(
                f"bad placeholder {{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} in {template!r}: only plain {{field}} names are allowed"
            )
        names.append(name)
    return names


def _interpreter_flag(program: str) -> str | None:
    name = PurePath(program).name
    if name in _INLINE_CODE:
        return _INLINE_CODE[name]
    for prefix, flag in _INLINE_CODE_PREFIX.items():
        if name.startswith(prefix):
            return flag
    return None


def _refuse_inline_code(argv: list[str]) -> None:
    """Refuse placeholders in code handed to an interpreter (``sh -c``, ``python -c``, ...)."""
    flag = _interpreter_flag(argv[0])
    if flag is None:
        return
    letter = flag[1]
    for i, arg in enumerate(argv[1:-1], start=1):
        is_flag = arg == flag or (arg.startswith("-") and not arg.startswith("--") and letter in arg)
        if is_flag and placeholders(argv[i + 1]):
            raise ConfigError(
                f"the command passes a {{placeholder}} to {argv[0]} {arg} as code, which a task field "
                f'could use to run commands; read it from the environment instead ("$TASK_<FIELD>")'
            )


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def render_argv(argv: list[str], values: Mapping[str, str], *, task_id: str) -> list[str]:
    """Each argument with its placeholders replaced (one argument stays one argument)."""
    rendered: list[str] = []
    for arg in argv:
        missing = [name for name in placeholders(arg) if name not in values]
        if missing:
            raise ConfigError(f"task {task_id!r} has no field {missing[0]!r} used by the template {arg!r}")
        rendered.append(arg.format_map(values))
    return rendered


def template_values(task: Task, builtins: Mapping[str, str]) -> dict[str, str]:
    """Placeholder values: the task's top-level fields, then the built-ins over them."""
    values = {key: as_text(value) for key, value in task.data.items() if isinstance(key, str)}
    values.update(builtins)
    return values


def env_name(field: str) -> str:
    return "TASK_" + re.sub(r"[^A-Za-z0-9]", "_", field).upper()


def task_env(task: Task) -> dict[str, str]:
    """``TASK_ID`` and ``TASK_<FIELD>`` for each top-level field (long ones left out)."""
    env = {"TASK_ID": task.id}
    for key, value in task.data.items():
        text = as_text(value)
        if isinstance(key, str) and len(text) <= MAX_ENV_VALUE and "\0" not in text:
            env[env_name(key)] = text
    return env
