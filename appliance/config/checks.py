"""The checks of one field, each a ``ConfigError`` of one line that names the field, what it
may be and what it got; and ``umask_bits``, which reads ``data_umask``. The sections call them
when they are built; what a field means is its section's."""

from __future__ import annotations

import math
from collections.abc import Iterable

from contracts.errors import ConfigError


def one_of(name: str, value: object, allowed: Iterable[object]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def at_least(name: str, value: float | None, low: float, meaning: str = "") -> None:
    """``value`` (None passes: derived) must be ``low`` or more; ``meaning`` says what ``low`` means."""
    if value is not None and not value >= low:
        what = f"{low:g} ({meaning}) or more" if meaning else f"at least {low:g}"
        raise ConfigError(f"{name} must be {what}; got {value}")


def seconds(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number of seconds; got {value}")


def umask_bits(value: str) -> int:
    """``data_umask`` ("077") as bits; a ``ConfigError`` unless it is 3 or 4 octal digits that
    leave the owner every right (the appliance must read and write its own files)."""
    text = value.strip()
    if not (3 <= len(text) <= 4 and all(c in "01234567" for c in text)) or int(text, 8) > 0o777:
        raise ConfigError(f'data_umask must be octal like the shell\'s umask ("077", "027"); got {value!r}')
    bits = int(text, 8)
    if bits & 0o700:
        raise ConfigError(
            f"data_umask {value!r} takes rights away from the owner, which the appliance needs; "
            'use "0" for the owner\'s digit ("077", "027")'
        )
    return bits
