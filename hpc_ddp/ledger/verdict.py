"""The hang verdict, `<folder>/hang.json`: written once by the rank that decided it (hpc_ddp.run.watch.watchdog),
read by the supervisor that ends the attempt (the local launcher, the batch shell's `end` step, `submit
--wait`). A verdict older than the attempt is an earlier attempt's (`since`). No torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

VERDICT = "hang.json"


def path(folder: Path) -> Path:
    return Path(folder) / VERDICT


def write(folder: Path, record: dict[str, Any]) -> None:
    """Write the verdict atomically: a reader sees none or all of it."""
    write_json(path(folder), record)


def write_json(target: Path, record: dict[str, Any]) -> None:
    """One JSON file, written to a temporary name, made durable and renamed into place."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read(folder: Path, since: float = 0.0) -> dict[str, Any] | None:
    """The hang verdict of a run folder, if one was written after `since` (epoch seconds)."""
    try:
        if path(folder).stat().st_mtime < since:
            return None
        record = json.loads(path(folder).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
