"""How the suite spreads over pytest-xdist workers (env/test.sh runs `pytest -n N --dist loadgroup`).

Most of the suite's time is spent waiting (for ranks to rendezvous, for a watchdog or a timeout to fire, for
slurmctld to start, requeue or end a job), so on two cores a few workers finish it in about half the time. What
may run beside what, decided here at collection, on every worker alike (they must collect the same list):

  group "slurm"       every test marked slurm: they share the one local cluster (a test takes a node away,
                      fills the partition, waits for a requeue), so one worker runs them one after the other
  group "slurm2"      where env/test.sh started a second cluster (HPC_DDP_SLURM_DIR_2): the slurm tests of
                      the files in SECOND_CLUSTER, on that cluster (conftest's `slurm_cluster` points
                      SLURM_CONF there for the module), one after the other on another worker
  group "alone"       tests marked `alone`: timing-sensitive ones (a short watchdog limit that must not fire, a
                      straggler ratio, a signal that must land during a restart) and the CPU-bound benchmark
                      runs: one after the other on one worker, so none of them runs beside another (each
                      still runs beside the other groups' tests)
  group "<fixture>"   every test that reads a run shared through a module- or session-scoped fixture of the
                      suite's own (tests/*.py) runs on one worker, so the shared run happens once

Everything else is spread test by test. The biggest units go first (xdist hands units out in collection order:
its own reordering by test count is turned off), so the long Slurm chain starts at once and the last minutes
are spent on short tests: slurm, then by the costliest cost in the unit (scenario, ranks, process, unit).

Without pytest-xdist, or in a plain `pytest` run, nothing here does anything: the collection order stays the
files' own. Loaded by tests/conftest.py (`pytest_plugins`); `group()` is called by tests/costs.py once every
test has its cost marker.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SLURM = "slurm"
SLURM_2 = "slurm2"
# The Slurm files that run on the second cluster when there is one: about half the Slurm chain's time (in the
# last whole run: submit 383 s + fsdp 183 s against survive 511 s + early signal 70 s + doctor's srun runs).
SECOND_CLUSTER = ("test_launch_slurm_submit.py", "test_launch_slurm_fsdp.py", "test_launch_slurm_inplace.py")
SECOND_CLUSTER_DIR = "HPC_DDP_SLURM_DIR_2"  # its state folder, exported by env/test.sh


def second_cluster(path: Path) -> str | None:
    """The state folder of the cluster the slurm tests of this file use, if not the machine's first one."""
    state = os.environ.get(SECOND_CLUSTER_DIR)
    return state if state and path.name in SECOND_CLUSTER else None


ALONE = "alone"
# The costliest first; a unit's rank is its costliest test's.
ORDER = ("slurm", "scenario", "ranks", "process", "unit")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the options below
def pytest_configure(config: pytest.Config) -> None:
    if not _grouping(config) or not hasattr(config.option, "loadscopereorder"):
        return
    config.option.loadscopereorder = False  # the controller's scheduler: keep the order given below
    if config.option.maxworkerrestart is None:
        # A worker ends only when a test passes its deadline (tests/deadline.py: every stack, then _exit(1)).
        # Then the run stops, as it does in one process: xdist would start a worker again and hand it the
        # rest of that group, the stuck test first, up to 4 times per worker.
        config.option.maxworkerrestart = "0"


def _grouping(config: pytest.Config) -> bool:
    """`--dist loadgroup`: on the controller as given; a worker sees dist "no" and xdist's own `loadgroup`."""
    return getattr(config.option, "dist", "no") == "loadgroup" or getattr(config.option, "loadgroup", False)


def _suites_own(fixturedef: pytest.FixtureDef[object], root: Path) -> bool:
    """Defined in the repository's own files (tests/), not by pytest (tmp_path_factory...) or a plugin."""
    code = getattr(fixturedef.func, "__code__", None)
    if code is None:
        return False
    path = Path(code.co_filename).resolve()
    return path.is_relative_to(root) and "site-packages" not in path.parts


def shared_fixture(item: pytest.Item) -> str | None:
    """The first (by name) module- or session-scoped fixture of the suite's own that the test reads."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    root = item.config.rootpath.resolve()
    names = []
    for name, defs in info.name2fixturedefs.items():
        fixturedef = defs[-1]
        if fixturedef.scope in ("module", "package", "session") and _suites_own(fixturedef, root):
            names.append(f"{item.path.name}::{name}" if fixturedef.scope == "module" else name)
    return min(names) if names else None


def group_of(item: pytest.Item) -> str | None:
    """The xdist group the test runs in, or None to be spread on its own."""
    if item.get_closest_marker("slurm") is not None:
        return SLURM_2 if second_cluster(item.path) else SLURM
    if item.get_closest_marker(ALONE) is not None:
        return ALONE
    return shared_fixture(item)


def _rank(item: pytest.Item) -> int:
    return next((i for i, cost in enumerate(ORDER) if item.get_closest_marker(cost) is not None), len(ORDER))


def group(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`: mark each test's group, and put the costliest units first."""
    if not _grouping(config):
        return
    units: dict[str, int] = {}
    for item in items:
        name = group_of(item)
        if name == SLURM_2 and "slurm_cluster" not in getattr(item, "fixturenames", ()):
            # Only that fixture points SLURM_CONF at the second cluster: without it the test would use the
            # first one, beside the tests that worker runs there.
            raise pytest.UsageError(
                f"{item.nodeid} is marked slurm in a file of tests/workers.py's SECOND_CLUSTER but does not "
                "request the slurm_cluster fixture. Fix: add slurm_cluster to its arguments"
            )
        if name is not None:
            item.add_marker(pytest.mark.xdist_group(name))
        unit = name or item.nodeid
        units[unit] = min(units.get(unit, len(ORDER)), _rank(item))
    first = {unit: i for i, unit in enumerate(units)}  # in collection order: a stable sort
    items.sort(key=lambda item: (units[u := group_of(item) or item.nodeid], first[u]))
