"""Run through the fork server by tests/test_launch_local_forkserver.py: one JSON line of what a forked rank
sees, then the exit PROBE_EXIT asks for (a number, or a message as `sys.exit("...")` gives it)."""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy

print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            "probe": os.environ.get("PROBE"),
            "session_leader": os.getsid(0) == os.getpid(),
            "parent": os.getppid(),
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "draw": float(numpy.random.rand()),
            "stdin": os.readlink("/proc/self/fd/0"),
            "torch_imported": "torch._dynamo" in sys.modules,  # the server's import: none here
        }
    ),
    flush=True,
)
print("to stderr", file=sys.stderr, flush=True)
code = os.environ.get("PROBE_EXIT", "0")
sys.exit(int(code) if code.isdigit() else code)
