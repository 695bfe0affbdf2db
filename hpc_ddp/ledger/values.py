"""The values a run's records may hold, checked (pure): every reader of attempts.jsonl and metrics.jsonl takes
a number or a time stamp through these, so a field of the wrong type, or a value no run can have written (a
time stamp before 1970 or after TIME_MAX, a step past MAX_STEP), reads as missing (None) rather than fail.
The ledger's merge of attempts.jsonl (ledger.attempts.merge) and the report's reading of metrics.jsonl
(report.recorded) share them: one rule for what a record may say. No torch.
"""

from __future__ import annotations

import math
from typing import Any

TIME_MAX = 1e10  # seconds since the epoch: the year 2286. A later stamp is garbage (1e308 was one)
MAX_STEP = 2**53  # a step or count past this is garbage (and would not fit the compact arrays)


def int_or_none(value: Any) -> int | None:
    """An integer from a record (an integral float too), else None: missing, null, a string, out of range."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):  # json.loads reads Infinity
        return None
    return int(value) if abs(value) < MAX_STEP else None


def num(value: Any) -> float | None:
    """A finite number from a record, else None (missing, null, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def stamp(value: Any) -> float | None:
    """A time stamp from a record: seconds since the epoch, from 1970 to TIME_MAX; else None."""
    t = num(value)
    return t if t is not None and 0 <= t < TIME_MAX else None
