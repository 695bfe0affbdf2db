"""What each test costs: a cost marker on every test, and the seconds per test file at the end of every run.

Every test carries exactly one cost marker, so a lane is a marker expression and a new test says what it costs:

  unit       pure, in-process, fast (milliseconds to a second)
  process    starts one process (or a few, one after another): an entry point, a script, a nested pytest
  ranks      a local multi-rank run (the local launcher, gloo ranks, several processes that talk)
  slurm      the real local Slurm cluster (env/slurm/cluster.sh)
  scenario   a long multi-attempt story (restarts, requeues, crash loops; tens of seconds)

The cost comes from, first to last: a cost marker on the test, or else on its file (`pytestmark`; `slurm` is
one), an entry for the test in TESTS, its file's entry in FILES. A FILES entry is one cost, or a pair: the
cost of the file's tests without the `slow` marker, then of those with it (the files mix quick checks and real
runs). A test with no cost fails collection with a line that says where to add one.

`slow` means "not in the quick lane" (`-m "not slurm and not slow"`): added here to every ranks, slurm and
scenario test and to the files in NOT_QUICK; a test may also carry it itself (a long one-process run).

Loaded by tests/conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Generator

import pytest
import workers

COSTS = ("unit", "process", "ranks", "slurm", "scenario")
SLOW_COSTS = ("ranks", "slurm", "scenario")

# tests/<file>: its cost, or (cost without `slow`, cost with `slow`).
FILES: dict[str, str | tuple[str, str]] = {
    "test_architecture.py": "unit",
    "test_base.py": "unit",
    "test_bench.py": ("unit", "ranks"),
    "test_cluster_env.py": "unit",
    "test_cluster_hostlist.py": "unit",
    "test_cluster_placement.py": "unit",
    "test_cluster_settings.py": "unit",
    "test_deadline.py": "process",
    "test_doctor_facts.py": "unit",
    "test_doctor_rules.py": "unit",
    "test_doctor_runs.py": ("process", "ranks"),
    "test_doctor_resume.py": ("unit", "ranks"),
    "test_resume_zoo.py": ("unit", "ranks"),
    "test_entry_points.py": "process",
    "test_entry_usage_errors.py": "process",
    "test_gpu.py": "process",
    "test_gpu_check.py": "process",
    "test_launch_local.py": "ranks",
    "test_launch_local_console.py": ("unit", "ranks"),
    "test_launch_local_forkserver.py": "unit",
    "test_report_page.py": ("unit", "process"),
    "test_report_records.py": ("process", "ranks"),
    "test_run_progress_records.py": ("unit", "ranks"),
    "test_run_sinks.py": "unit",
    "test_plugins.py": ("process", "ranks"),
    "test_run_hot_path.py": "unit",
    "test_run_quiet.py": "unit",
    "test_run_params.py": "unit",
    "test_run_best.py": "unit",
    "test_run_loaders.py": "process",
    "test_run_checkpoint_seams.py": "unit",
    "test_run_save_failures.py": "unit",
    "test_scale.py": "process",
    "test_run_torchrun.py": ("process", "ranks"),
    "test_sweep.py": "unit",
    "test_sweep_local.py": "ranks",
    "test_sweep_array.py": "unit",
    "test_sweep_trackers.py": "process",
    "test_supervisor.py": "process",
    "test_variables.py": "unit",
    "test_docs.py": "process",
    "test_run_batches.py": "unit",
    "test_run_taskspec.py": "unit",
    "test_run_models.py": "ranks",
    "test_run_fsdp.py": "ranks",
    "test_run_fsdp_memory.py": "ranks",
    "test_run_gloo_comm.py": ("unit", "ranks"),
    "test_run_materialize.py": "unit",
    "test_run_memory.py": "unit",
    "test_run_snapshot.py": ("unit", "ranks"),
    "test_run_checkpoint_streamed.py": "unit",
    "test_run_checkpoint_dcpwrite.py": "unit",
    "test_run_checkpoint_sharded.py": "unit",
    "test_run_checkpoint_storage.py": "unit",
    "test_run_forkrisk.py": "unit",
    "test_run_loop_rules.py": "unit",
    "test_run_checkpoint_collisions.py": ("unit", "ranks"),
    "test_launch_slurm_client.py": "unit",
    "test_scheduler.py": "unit",
    "test_ledger_attempts.py": "unit",
    "test_ledger_judge.py": "unit",
    "test_ledger_decision.py": "unit",
    "test_launch_options.py": "unit",
    "test_launch_slurm_batch.py": "unit",
    "test_launch_slurm_endings.py": "unit",
    "test_launch_slurm_min_nodes.py": "unit",
    "test_launch_spares.py": ("unit", "ranks"),
    "test_launch_faults.py": "unit",
    "test_launch_slurm_start.py": "process",
    "test_launch_slurm_runtime.py": ("unit", "process"),
    "test_launch_slurm_follow.py": "unit",
    "test_launch_local_faults.py": "ranks",
    "test_launch_local_retry.py": "scenario",
    "test_launch_restart_signals.py": "scenario",
    "test_launch_slurm.py": ("unit", "process"),
    "test_launch_slurm_submit.py": "slurm",
    "test_launch_slurm_survive.py": "slurm",
    "test_launch_slurm_early_signal.py": "slurm",
    "test_launch_slurm_fsdp.py": "slurm",
    "test_launch_slurm_inplace.py": "slurm",
    "test_report.py": "unit",
    "test_report_run.py": "ranks",
    "test_report_scenario.py": "scenario",
    "test_run_checkpoint.py": ("unit", "process"),
    "test_run_checkpoint_integrity.py": "unit",
    "test_run_config.py": "unit",
    "test_run_configfile.py": "unit",
    "test_run_help.py": "unit",
    "test_run_folder.py": "unit",
    "test_run_folder_rules.py": ("unit", "process"),
    "test_run_full_disk.py": ("unit", "ranks"),
    "test_run_hang.py": "ranks",
    "test_run_hang_rules.py": "unit",
    "test_run_nonfinite.py": "ranks",
    "test_run_preemption.py": "scenario",
    "test_run_preemption_rules.py": "unit",
    "test_run_progress.py": "unit",
    "test_run_progress_runs.py": ("process", "ranks"),
    "test_run_retry_rules.py": "unit",
    "test_run_rng.py": "unit",
    "test_run_save_retry.py": "process",
    "test_run_tasks.py": "unit",
    "test_run_teardown.py": ("unit", "process"),
    "test_run_trainer.py": "unit",
    "test_run_callbacks.py": ("unit", "ranks"),
    "test_run_task_args.py": ("unit", "ranks"),
    "test_run_exact.py": "process",
    "test_run_exact_ranks.py": "ranks",
    "test_suite.py": ("unit", "process"),
}

# tests/<file>::<function>: a test whose cost differs from its file's entry (a stale name fails collection).
TESTS: dict[str, str] = {
    "test_launch_local_forkserver.py::test_a_forked_rank_is_the_starters_child_and_exits_as_python_would": "process",
    "test_launch_local_forkserver.py::test_a_forked_rank_sees_what_python_m_would_give_it": "process",
    "test_bench.py::test_help_explains_each_section": "process",
    "test_bench.py::test_bad_arguments_are_one_line_usage_errors": "process",
    "test_cluster_placement.py::test_apply_cpu_plan_pins_and_sizes_threads": "process",
    "test_launch_slurm.py::test_print_sbatch_matches_the_golden_file": "process",
    "test_launch_slurm.py::test_print_sbatch_is_valid_bash_with_the_resource_lines": "process",
    "test_launch_slurm.py::test_ddp_sbatch_is_valid_bash": "process",
    "test_launch_slurm.py::test_ddp_sbatch_and_print_sbatch_are_the_same_job": "process",
    "test_launch_slurm.py::test_bad_slurm_flags_exit_2_with_one_line": "process",
    "test_launch_slurm.py::test_no_sbatch_on_path_exits_2_with_one_line": "process",
    "test_launch_slurm.py::test_ddp_sbatch_requeues_only_for_a_preempted_exit_that_asks_for_it": "process",
    "test_launch_slurm.py::test_ddp_sbatch_reads_the_run_folder_the_tasks_resolved_not_its_arguments": "process",
    "test_launch_slurm.py::test_ddp_sbatch_finds_the_run_folder_itself_when_the_tasks_never_told_it": "process",
    "test_launch_slurm.py::test_ddp_sbatch_keeps_waiting_for_the_tasks_after_sigterm": "process",
    "test_report.py::test_the_command_writes_one_self_contained_page_and_the_pngs": "process",
    "test_report.py::test_out_elsewhere": "process",
    "test_report.py::test_a_folder_that_is_no_run_folder_is_one_line_and_exit_2": "process",
    "test_report.py::test_without_matplotlib_the_command_says_how_to_install_it": "process",
    "test_report.py::test_queue_waits_come_from_sacct_when_it_answers": "process",
    "test_report.py::test_help_is_quick_and_options_are_never_abbreviated": "process",
    "test_report.py::test_a_lock_left_by_a_killed_run_is_no_running_run": "process",
    "test_run_folder_rules.py::test_a_second_run_in_a_live_folder_is_refused_and_the_lock_dies_with_its_holder": (
        "ranks"
    ),
    "test_run_folder_rules.py::test_a_refused_start_writes_no_record_and_earlier_starts_are_kept": "ranks",
    "test_run_progress_runs.py::test_a_task_alone_on_a_terminal_rewrites_its_live_line_and_its_other_lines_erase_it": (
        "process"
    ),
    "test_run_progress_runs.py::test_tensorboard_curves_go_on_across_a_preemption_and_a_crash_with_no_step_twice": (
        "scenario"
    ),
    "test_run_teardown.py::test_any_error_on_rank0_reaches_every_rank_at_once": "ranks",
    "test_run_teardown.py::test_a_usage_error_on_rank_0_alone_is_the_first_cause_not_its_peer_s_closed_connection": (
        "ranks"
    ),
    "test_launch_slurm_min_nodes.py::test_the_batch_scripts_take_the_task_count_from_the_allocation": "process",
}

# Files out of the quick lane whatever their cost: pytest run inside pytest.
NOT_QUICK = ("test_deadline.py",)


def _where(item: pytest.Item) -> tuple[str, str]:
    return item.path.name, getattr(item, "originalname", item.name)


def cost_of(item: pytest.Item) -> str | None:
    """The test's cost marker, from the test itself, TESTS or FILES; None when it has none."""
    own = sorted({m.name for m in item.own_markers if m.name in COSTS})
    if len(own) > 1:
        raise pytest.UsageError(f"{item.nodeid}: two cost markers ({', '.join(own)}); keep one")
    marked = next((m.name for m in item.iter_markers() if m.name in COSTS), None)  # the closest: the test's
    if marked is not None:
        return marked
    file, function = _where(item)
    if f"{file}::{function}" in TESTS:
        return TESTS[f"{file}::{function}"]
    entry = FILES.get(file)
    if isinstance(entry, tuple):
        return entry[item.get_closest_marker("slow") is not None]
    return entry


def _stale_tests(items: list[pytest.Item]) -> list[str]:
    """TESTS entries for a collected file that no longer has that function."""
    modules = {item.path.name: getattr(item, "module", None) for item in items}
    stale = []
    for key in TESTS:
        file, function = key.split("::")
        module = modules.get(file)
        if module is not None and not hasattr(module, function):
            stale.append(key)
    return stale


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers given here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = []
    for item in items:
        cost = cost_of(item)
        if cost is None:
            missing.append(item.nodeid)
            continue
        item.add_marker(cost)
        # In the reports' user_properties the cost travels to pytest-xdist's controller too.
        item.user_properties.append(("cost", cost))
        if cost in SLOW_COSTS or item.path.name in NOT_QUICK:
            item.add_marker("slow")
    if missing:
        raise pytest.UsageError(
            f"{len(missing)} test(s) without a cost marker, first {missing[0]}. Fix: add the file to FILES "
            f"in tests/costs.py, or mark the test: @pytest.mark.<cost> with one of {', '.join(COSTS)}"
        )
    stale = _stale_tests(items)
    if stale:
        raise pytest.UsageError(f"tests/costs.py: TESTS names tests that are gone: {', '.join(stale)}")
    workers.group(config, items)  # under pytest-xdist: who may run beside whom, the costliest first


# ----- seconds per test file, at the end of every run ---------------------------------------------------
#
# Wall seconds and CPU seconds (this process and every child it waited for: the ranks, the launchers, nested
# pytest) side by side: a file whose CPU is far below its wall waits (sleeps, timeouts, Slurm), one whose CPU
# is near or above its wall computes, and only waiting files gain from more pytest-xdist workers on 2 cores.
# Each phase's CPU seconds travel in the report's user_properties, so under pytest-xdist the controller, which
# prints the table, gets every worker's figures.

_CPU_MARK = pytest.StashKey[float]()
_seconds: defaultdict[str, float] = defaultdict(float)
_cpu: defaultdict[str, float] = defaultdict(float)
_tests: defaultdict[str, int] = defaultdict(int)
_cost_seconds: defaultdict[str, float] = defaultdict(float)


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and of the children it has waited for, so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    item.stash[_CPU_MARK] = cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    now = cpu_s()
    report.user_properties = [*report.user_properties, ("cpu_s", now - item.stash.get(_CPU_MARK, now))]
    item.stash[_CPU_MARK] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = report.nodeid.split("::")[0]
    properties = dict(report.user_properties)
    _seconds[file] += report.duration
    _cpu[file] += properties.get("cpu_s", 0.0)
    _cost_seconds[properties.get("cost", "?")] += report.duration
    if report.when == "teardown":
        _tests[file] += 1


@pytest.hookimpl(trylast=True)  # after --durations' list, just above the short summary and the last line
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    tr = terminalreporter
    tr.write_sep("=", "seconds per test file (setup + call + teardown, slowest first; wall, then CPU)")
    for file, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{seconds:8.1f} s {_cpu[file]:8.1f} cpu-s {_tests[file]:5d} tests  {file}")
    total = sum(_seconds.values())
    tr.write_line(f"{total:8.1f} s {sum(_cpu.values()):8.1f} cpu-s {sum(_tests.values()):5d} tests  in all")
    by_cost = sorted(_cost_seconds.items(), key=lambda kv: -kv[1])
    tr.write_line("by cost: " + ", ".join(f"{cost} {seconds:.1f} s" for cost, seconds in by_cost))
