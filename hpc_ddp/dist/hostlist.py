"""Deprecated alias of `hpc_ddp.cluster.hostlist` (public since 0.1; removed in the release after 0.2)."""

from __future__ import annotations

import warnings

from hpc_ddp.cluster.hostlist import *  # noqa: F403  (the public names: expand, HostlistError, ...)
from hpc_ddp.cluster.hostlist import __all__  # noqa: F401

warnings.warn("hpc_ddp.dist.hostlist is now hpc_ddp.cluster.hostlist; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
