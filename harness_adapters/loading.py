"""Loading user code named by a dotted path: ``package.module:attribute``.

Owns the one way an adapter, a reward function or an external runner's agent is found from the
text a user wrote in a config or on a command line, and the readable ``ConfigError`` when it is
not there. It does not call what it loads.
"""

from __future__ import annotations

import importlib
from typing import Any

from contracts.errors import ConfigError


def load_object(target: str, *, what: str = "agent") -> Any:
    """Import ``package.module:attribute``; a readable ConfigError if it is not there."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} must look like 'package.module:function'; got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {what} module {module_name!r}: {exc}") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ConfigError(f"{module_name!r} has no callable {attr!r}")
    return obj
