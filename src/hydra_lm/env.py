"""Reading boolean switches from the environment (at import or start-up, never in a forward)."""

from __future__ import annotations

import os
import warnings

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    # A typo in an environment variable must not make the package unimportable.
    warnings.warn(f"{name}={raw!r} is not a boolean (use 1/0); keeping the default {int(default)}", stacklevel=3)
    return default
