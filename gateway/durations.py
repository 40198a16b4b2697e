"""Durations as people type them: `90s`, `15m`, `12h`, `30d`, `2w` (a bare number is seconds)."""
from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PATTERN = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> int:
    """Seconds in `text`; ValueError with the accepted forms when it is not a duration."""
    match = _PATTERN.match(text or "")
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 12h, 30d, 2w)")
    return int(match.group(1)) * UNITS[match.group(2) or "s"]
