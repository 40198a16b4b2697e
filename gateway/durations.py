"""Durations as people type them: `90s`, `15m`, `12h`, `30d`, `2w` (a bare number is seconds)."""
from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_DIGITS = 10  # ~190,000 years in weeks: every use clamps or bounds it; 10,000 digits never parse
_PATTERN = re.compile(r"^\s*(\d{1,%d})\s*([smhdw]?)\s*$" % MAX_DIGITS)


def parse_duration(text: str) -> int:
    """Seconds in `text`; ValueError with the accepted forms when it is not a duration."""
    text = text or ""
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"not a duration: {text[:40]!r} (use e.g. 90s, 15m, 12h, 30d, 2w; "
                         f"at most {MAX_DIGITS} digits)")
    return int(match.group(1)) * UNITS[match.group(2) or "s"]
