"""Turn what people write for a duration ("500ms", "5m", timedelta, 30) into float seconds."""

from __future__ import annotations

import math
import re
from datetime import timedelta

Duration = float | int | timedelta | str

#: The longest duration taken: a wait longer than this is a mistake, and the platform's timers
#: (threading.TIMEOUT_MAX, about 292 years) overflow not far above it.
MAX_DURATION = 100 * 365 * 86400.0

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d)")


def _parse_text(name: str, text: str) -> float:
    compact = text.strip().lower().replace(" ", "")
    if not compact:
        raise ValueError(f"{name} must not be an empty string")
    try:
        return float(compact)
    except ValueError:
        pass
    total, pos = 0.0, 0
    for match in _PART.finditer(compact):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(compact):
        raise ValueError(
            f"{name} could not be parsed from {text!r}: use seconds (30, 0.5), a timedelta "
            f'or a string like "500ms", "30s", "5m", "1h", "1h30m"'
        )
    return total


def to_seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    """Return `value` as finite float seconds; raise naming `name` when it is not a duration.

    `allow_zero` admits 0 (a timeout of 0 means "don't wait"); negative values never pass.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be seconds, a timedelta or a duration string, got a bool")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    elif isinstance(value, str):
        seconds = _parse_text(name, value)
    else:
        raise TypeError(
            f"{name} must be seconds (int/float), a timedelta or a duration string, "
            f"got {type(value).__name__}"
        )
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    if seconds > MAX_DURATION:
        raise ValueError(
            f"{name} must be at most {MAX_DURATION:g} seconds (100 years), got {value!r}"
        )
    return seconds
