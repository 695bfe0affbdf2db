"""The supervisor's unit tables, run through a third party's scheduler: `test-slurm` of the test plugin package
(tests/data/plugin_pkg: the built-in Slurm client derived, logging each call of the interface) over a fake
cluster (tests/fake_slurm.py), for the batch shell's `begin` and `end` and the `--wait` follower. They ask the
Scheduler interface for srun's word, the lost nodes, the usable nodes left, the requeue and the cancel
(hpc_ddp.scheduler.base), so a plugin's scheduler drives them as the built-in does (issue 43 item 7). A test
module uses it as

    from plugin_scheduler import calls, client, through_the_plugin  # noqa: F401 (an autouse fixture)

and builds its client with `client(fake)`; `calls()` is what the plugin logged so far ("usable", "lost", ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from fake_slurm import FakeSlurm

from hpc_ddp import scheduler
from hpc_ddp.scheduler.slurm.client import SlurmClient

PLUGIN_PKG = ROOT / "tests" / "data" / "plugin_pkg"
LOG_VAR = "TESTPLUGIN_CALLS_LOG"  # hpc_ddp_testplugin.LOG
_log: list[Path] = []


@pytest.fixture(autouse=True)
def through_the_plugin(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The plugin's distribution on sys.path (found by importlib.metadata) and its calls logged, for one test."""
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    log = tmp_path_factory.mktemp("plugin") / "calls.log"
    monkeypatch.setenv(LOG_VAR, str(log))
    _log[:] = [log]
    yield
    _log.clear()


def client(fake: FakeSlurm | None = None) -> SlurmClient:
    """The plugin's scheduler, by name through the registry, over `fake`."""
    found = scheduler.of("test-slurm", runner=fake or FakeSlurm())
    assert type(found).__name__ == "TestSlurmScheduler" and isinstance(found, SlurmClient)
    return found


def calls() -> list[str]:
    """The plugin scheduler's methods called in this test so far, in order."""
    if not _log or not _log[0].exists():
        return []
    return [line.split()[1] for line in _log[0].read_text().splitlines() if line.startswith("scheduler ")]
