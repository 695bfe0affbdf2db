"""A third party's plugin package for the kit's tests (tests/test_plugins.py): a strategy, a checkpoint format, a
storage, a sink and a scheduler, each derived from a built-in, overriding nothing but to log its calls.

Found without installing: its `hpc_ddp_testplugin-0.1.dist-info` (entry_points.txt, METADATA) lies beside it,
so importlib.metadata finds it once this folder is on the path (PYTHONPATH for a run, sys.path in process).
Each call appends "<kind> <method> <rank> [<what>]" to the file $TESTPLUGIN_CALLS_LOG names (nothing when unset;
<rank> is "-" outside a rank: the launcher, a tool).
"""

from __future__ import annotations

import os

LOG = "TESTPLUGIN_CALLS_LOG"


def log(kind: str, method: str, what: str = "") -> None:
    path = os.environ.get(LOG)
    if not path:
        return
    line = f"{kind} {method} {os.environ.get('RANK', '-')} {what}".rstrip() + "\n"
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )  # one write per line: ranks interleave whole
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
