"""The public plugin API (hpc_ddp.plugins, hpc_ddp.registry, docs/plugins.md), proved by a third party's package.

tests/data/plugin_pkg holds `hpc_ddp_testplugin` and its dist-info (entry_points.txt, METADATA): on the path,
importlib.metadata finds it as if installed. Its strategy, format, storage, sink and scheduler each derive
from a built-in and log their calls to the file $TESTPLUGIN_CALLS_LOG names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_environ

from hpc_ddp import registry
from hpc_ddp.errors import UsageError

PLUGIN_PKG = ROOT / "tests" / "data" / "plugin_pkg"
PLUGIN_NAMES = {
    registry.strategies: ["test-broken", "test-ddp"],
    registry.checkpoint_formats: ["test-full"],
    registry.storages: ["test-local"],
    registry.sinks: ["test-sink"],
    registry.schedulers: ["test-local", "test-slurm"],
}


@pytest.fixture
def plugged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test plugin's distribution on sys.path (found by importlib.metadata, as an installed one)."""
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))


# ----- the registries --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reg", registry.ALL, ids=lambda r: r.group)
def test_the_builtins_alone_without_a_plugin(reg: registry.Registry) -> None:
    assert reg.names() == tuple(registry.BUILTINS[reg.group])
    assert all(e.builtin for e in reg.entries().values())


@pytest.mark.parametrize("reg", registry.ALL, ids=lambda r: r.group)
def test_a_plugins_names_come_after_the_builtins(plugged: None, reg: registry.Registry) -> None:
    names = reg.names()
    builtins = tuple(registry.BUILTINS[reg.group])
    assert names[: len(builtins)] == builtins  # the kit's own first, as submitit lists its executors
    assert sorted(names[len(builtins) :]) == PLUGIN_NAMES[reg]
    assert {reg.entry(n).dist for n in PLUGIN_NAMES[reg]} == {"hpc-ddp-testplugin"}


def test_pyproject_declares_the_builtin_table() -> None:
    """The kit's entry points (an install's) and the table a source checkout falls back to say the same."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared == registry.BUILTINS


def test_the_kits_own_entry_points_are_used_when_its_metadata_has_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the kit installed (its metadata declaring the groups), the registry reads them, not the table."""
    own = [registry.Entry("ddp", "hpc_ddp.run.strategy.ddp:DDPStrategy", registry.KIT)]
    other = [registry.Entry("zz", "x:Y", "other-dist"), registry.Entry("ddp", "evil:DDP", "other-dist")]
    monkeypatch.setattr(registry, "_declared", lambda group: other + own)
    entries = registry.strategies.entries()
    assert list(entries) == ["ddp", "zz"]  # no fsdp: the metadata said only ddp; a taken name stays the kit's
    assert entries["ddp"].value == "hpc_ddp.run.strategy.ddp:DDPStrategy"


def test_an_unknown_name_is_one_line_listing_the_names(plugged: None) -> None:
    with pytest.raises(UsageError) as e:
        registry.strategies.load("nope")
    assert "\n" not in str(e.value)
    assert "--strategy nope: choose one of ddp, fsdp, test-broken, test-ddp (" in str(e.value)
    assert "entry point group hpc_ddp.strategies" in str(e.value)


def test_a_broken_plugin_is_one_line_naming_its_package_and_the_others_load(plugged: None) -> None:
    with pytest.raises(registry.PluginError) as e:
        registry.strategies.load("test-broken")
    line = str(e.value)
    assert "\n" not in line
    assert "hpc-ddp-testplugin" in line and "ModuleNotFoundError" in line
    assert "hpc_ddp_testplugin_missing_dependency" in line
    from hpc_ddp.run.strategy.ddp import DDPStrategy

    assert issubclass(registry.strategies.load("test-ddp"), DDPStrategy)
    assert registry.strategies.load("ddp") is DDPStrategy


def test_the_builtin_traits_are_what_the_classes_declare() -> None:
    """The table the torch-free config checks read says what each built-in class itself declares."""
    for group, table in registry.BUILTIN_TRAITS.items():
        reg = next(r for r in registry.ALL if r.group == group)
        for name, traits in table.items():
            cls = reg.load(name)
            assert {k: getattr(cls, k) for k in traits} == traits, (group, name)


def test_a_plugins_traits_come_from_its_class(plugged: None) -> None:
    from hpc_ddp.run.config import TrainConfig

    assert registry.strategies.trait("test-ddp", "shards_model") is False
    cfg = TrainConfig(strategy="test-ddp", checkpoint_format="test-full", checkpoint_storage="test-local")
    assert cfg.format_name() == "test-full" and not cfg.format_shards()
    assert TrainConfig(strategy="test-ddp").format_name() == "full"  # auto, as under ddp
    with pytest.raises(UsageError, match="--checkpoint-format sharded needs --strategy fsdp"):
        TrainConfig(strategy="test-ddp", checkpoint_format="sharded")
    with pytest.raises(UsageError, match="applies to --strategy fsdp only"):
        TrainConfig(strategy="test-ddp", reshard_after_forward="false")
    with pytest.raises(UsageError, match="--checkpoint-storage nope: choose one of local, test-local"):
        TrainConfig(checkpoint_storage="nope")


def test_importing_the_api_and_listing_names_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import hpc_ddp.plugins as p\n"
        "names = [r.names() for r in (p.strategies, p.checkpoint_formats, p.storages, p.sinks, p.schedulers)]\n"
        "p.Storage, p.LocalStorage, p.Sink, p.Scheduler\n"
        "from hpc_ddp.run.config import TrainConfig\n"
        "TrainConfig(strategy='fsdp', min_nodes=0).format_name()\n"
        "print(names[0], 'torch' in sys.modules)\n"
    )
    env = clean_environ(PYTHONPATH=f"{ROOT}:{PLUGIN_PKG}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.strip() == "('ddp', 'fsdp', 'test-broken', 'test-ddp') False", out.stdout + out.stderr


def test_help_lists_the_names_installed_and_an_unknown_one_is_exit_2() -> None:
    env = clean_environ(PYTHONPATH=f"{ROOT}:{PLUGIN_PKG}", COLUMNS="1000")  # no line wrapped inside a name
    cmd = [sys.executable, "-m", "hpc_ddp.train"]
    shown = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60, env=env)
    flat = " ".join(shown.stdout.split())
    assert "installed: ddp, fsdp, test-broken, test-ddp" in flat
    assert "installed: auto, full, sharded, test-full" in flat
    assert "installed: local, test-local" in flat
    assert "installed: wandb, mlflow, test-sink" in flat
    bad = subprocess.run(
        [*cmd, "--strategy", "test-ddpp", "--folder", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert (
        "--strategy test-ddpp: choose one of ddp, fsdp, test-broken, test-ddp" in bad.stderr
        and "Traceback" not in bad.stderr
    )
    broken = subprocess.run(
        [*cmd, "--strategy", "test-broken", "--folder", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1, broken.stderr
    assert "the plugin from package hpc-ddp-testplugin" in broken.stderr and "Traceback" not in broken.stderr


def test_a_plugin_of_the_public_api_is_a_subclass_of_its_builtin() -> None:
    import hpc_ddp.plugins as p
    from hpc_ddp.run.checkpoint.full import Full
    from hpc_ddp.run.checkpoint.sharded import Sharded

    assert p.FullFormat is Full and p.ShardedFormat is Sharded and issubclass(Full, p.Format)
    assert issubclass(p.DDPStrategy, p.Strategy) and issubclass(p.FSDPStrategy, p.Strategy)
    assert issubclass(p.LocalStorage, p.Storage)
    with pytest.raises(AttributeError):
        p.Nothing  # noqa: B018


# ----- the scheduler plugin: found by name, and it answers the local emulation's tables ------------------------
def test_the_scheduler_plugin_is_found_by_name_and_answers_as_the_local_one(
    plugged: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import inspect

    from hpc_ddp import scheduler
    from hpc_ddp.scheduler.base import Scheduler
    from hpc_ddp.scheduler.local import LocalScheduler

    log = tmp_path / "calls.log"
    monkeypatch.setenv("TESTPLUGIN_CALLS_LOG", str(log))
    plugin = scheduler.of("test-local", nodes=3)
    assert type(plugin).__name__ == "TestLocalScheduler" and isinstance(plugin, LocalScheduler)
    # tests/test_scheduler.py's tables, asked of the plugin: the whole interface, and the same answers.
    wanted = {n for n, v in vars(Scheduler).items() if inspect.isfunction(v) and not n.startswith("_")}
    for name in wanted:
        theirs, ours = (
            inspect.signature(getattr(type(plugin), name)),
            inspect.signature(getattr(Scheduler, name)),
        )
        assert list(theirs.parameters) == list(ours.parameters), name
    local = LocalScheduler(nodes=3)
    usable = plugin.usable()
    assert usable == local.usable() and len(usable) == 3
    environ = {"SLURM_JOB_ID": "12", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert plugin.identity(environ) == local.identity(environ)
    assert log.read_text().split() == ["scheduler", "usable", "-", "scheduler", "identity", "-"]
    with pytest.raises(ValueError, match="no scheduler named 'pbs'"):
        scheduler.of("pbs")


# ----- the proof: a preempted and resumed run with every plugin by name, bitwise equal to the built-ins' -----------
@pytest.mark.slow
@pytest.mark.deadline(400)
def test_a_run_with_every_plugin_preempted_twice_ends_bitwise_equal_to_the_builtins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from test_run_callbacks import TWO
    from test_run_models import finish, preempted_twice, start

    args = ("--task", "slow_tasks:slow", *TWO, "--epochs", "3", "--lr", "0.005")
    path = {"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}:{PLUGIN_PKG}"}
    code, out = finish(start(tmp_path / "builtins", *args, SLOW_TASK_SLEEP_S="0", **path))
    assert code == 0, out
    log = tmp_path / "calls.log"
    plugins = (
        "--strategy",
        "test-ddp",
        "--checkpoint-format",
        "test-full",
        "--checkpoint-storage",
        "test-local",
        "--tracker",
        "test-sink",
    )
    out = preempted_twice(
        tmp_path / "plugins", *args, *plugins, SLOW_TASK_SLEEP_S="0.03", TESTPLUGIN_CALLS_LOG=str(log), **path
    )
    assert out.count("Resuming from ") == 2
    models = [torch.load(tmp_path / f / "model.pth", weights_only=True) for f in ("builtins", "plugins")]
    assert models[0].keys() == models[1].keys() and models[0]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    lines = log.read_text().splitlines()
    calls = {tuple(line.split()[:2]) for line in lines}
    assert {line.split()[2] for line in lines if line.startswith("strategy setup")} == {
        "0",
        "1",
    }  # every rank
    for call in [
        ("strategy", "setup"),
        ("strategy", "model_state"),
        ("strategy", "load_model_state"),
        ("format", "stage"),
        ("format", "open"),
        ("storage", "write"),
        ("storage", "write_bytes"),
        ("sink", "open"),
        ("sink", "record:step"),
        ("sink", "record:end"),
        ("sink", "close"),
    ]:
        assert call in calls, (call, sorted(calls))
    # Storage all the way through (issue 43): the resume's reads, the launcher's latest step and model.pth go
    # through the storage --checkpoint-storage names, never around it. (kind, method, rank, name) per call:
    storage = [tuple(line.split()) for line in lines if line.startswith("storage ")]

    def ranks(method: str, name: str) -> set[str]:
        return {c[2] for c in storage if c[1] == method and len(c) > 3 and c[3].startswith(name)}

    assert ranks("open", "ckpt-") == {"0", "1"}, storage  # every rank reads the checkpoint it resumes
    assert "0" in ranks("sha256", "ckpt-") and "0" in ranks("read_bytes", "ckpt-")  # rank 0 verifies it first
    assert "0" in ranks("read_bytes", "latest")  # which one: rank 0 reads `latest`
    launcher = ranks("read_bytes", "latest") | ranks("listdir", "checkpoints")
    assert "-" in launcher  # the launcher's latest step, at each attempt's end
    assert ranks("write", "model.pth") == {"0"}  # the export at the end, through the run's storage
    _the_tools_read_the_plugin_run_through_its_storage(tmp_path, monkeypatch, models[1])


def _the_tools_read_the_plugin_run_through_its_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_pth: dict
) -> None:
    """`python -m hpc_ddp.checkpoint export --checkpoint-storage` and `load_model(checkpoint_storage=)` on the
    plugin run: its format (the plugin's, derived from the full one) reads it through its storage, and what
    they give is model.pth, bit for bit."""
    import torch
    from slow_tasks import slow

    from hpc_ddp.checkpoint import load_model
    from hpc_ddp.checkpoint.__main__ import main
    from hpc_ddp.run.config import TrainConfig

    log = tmp_path / "tools.log"
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    monkeypatch.setenv("TESTPLUGIN_CALLS_LOG", str(log))
    monkeypatch.delenv("RANK", raising=False)
    latest = tmp_path / "plugins" / "checkpoints" / "latest"
    out = tmp_path / "exported.pth"
    options = ["--checkpoint-storage", "test-local", "--checkpoint-format", "test-full"]
    assert main(["export", *options, str(latest), str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    model = load_model(
        slow(TrainConfig()).model, latest, checkpoint_storage="test-local", checkpoint_format="test-full"
    )
    for state in (exported, model.state_dict()):
        assert state.keys() == model_pth.keys() and all(
            torch.equal(state[k], model_pth[k]) for k in model_pth
        )
    calls = log.read_text().splitlines()
    for call in ("storage read_bytes - latest", "storage open - ckpt-", "storage write - exported.pth"):
        assert any(line.startswith(call) for line in calls), (call, calls)
    assert "format export -" in calls and "format load_model -" in calls, calls
