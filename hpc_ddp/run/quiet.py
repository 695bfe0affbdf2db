"""What a rank prints that is not its own: Python's warnings, one line each, and none the kit answers itself.

A warning of Python's default format is two lines: the warning, then the source line that raised it, indented
(`  self._try_replicate_spec_for_scalar_tensor(`): on the console that second line is a scrap without context,
and in a log it is the warning's noise again. A rank prints each warning as its first line only, with the path
inside the installed package (`torch/distributed/...py:701`) rather than the whole site-packages path.

torch's DataLoader warns, once per loader and rank, when its workers outnumber the CPUs the rank may use (its
"suggested max number of worker"); the kit chooses that number itself (cluster/placement.plan_workers) and,
when the user's --num-workers exceeds the share, says so once in its own words, so torch's copy is left out.
"""

from __future__ import annotations

import warnings

SITE = "-packages/"  # site-packages or dist-packages: what follows is the package's own path
ANSWERED = (r"This DataLoader will create \d+ worker processes in total",)  # said by the kit instead


def one_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """warnings.formatwarning: the warning on one line, without the source line under it."""
    where = filename.split(SITE, 1)[1] if SITE in filename else filename
    text = " ".join(str(message).split())
    return f"{where}:{lineno}: {category.__name__}: {text}\n"


def install() -> None:
    """In a rank, before torch is imported: one-line warnings, and torch's that the kit answers left out."""
    warnings.formatwarning = one_line  # type: ignore[assignment]
    for message in ANSWERED:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
