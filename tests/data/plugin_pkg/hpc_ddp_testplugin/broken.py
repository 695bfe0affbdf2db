"""A plugin whose module fails to import (tests/test_plugins.py: one line naming the package, the others work)."""

import hpc_ddp_testplugin_missing_dependency  # noqa: F401
