"""The local launcher's fork server (hpc_ddp.launch.local.forkserver): which ranks it may fork (a table), and one
real server: a forked rank is the starter's child, named for its rank, runs `python -m` as the interpreter would
(its output, its exit code), and a rank whose start-up environment differs starts the plain way, said once.

Every local run of the suite forks its ranks through it: tests/test_launch_local.py finds them by name, kills
one, and kills the launcher and sees every rank and the server go."""

from __future__ import annotations

import json
import os

import psutil
import pytest
from conftest import clean_environ

from hpc_ddp import exitcodes
from hpc_ddp.launch.local import forkserver, processes

SERVER = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    ("rank", "found"),
    [
        ({}, []),
        # What the launcher adds to each rank's environment: none of it is read at start-up.
        ({"SLURM_PROCID": "1", "HPC_DDP_FOLDER_LOCK": "x", "CUDA_VISIBLE_DEVICES": ""}, []),
        ({"PYTHONUNBUFFERED": "0"}, []),  # the server runs -u, as every rank does
        ({"PYTHONPATH": "/elsewhere"}, ["PYTHONPATH"]),
        ({"OMP_NUM_THREADS": "4", "LD_PRELOAD": "x.so"}, ["LD_PRELOAD", "OMP_NUM_THREADS"]),
        ({"TORCH_LOGS": "+dynamo"}, ["TORCH_LOGS"]),
        ({"LANG": "C"}, ["LANG"]),  # the standard streams' encoding, opened by the server
    ],
)
def test_a_rank_is_forked_only_when_what_start_up_reads_is_the_servers(rank: dict, found: list) -> None:
    assert forkserver.startup_differences(SERVER, {**SERVER, **rank}) == found
    assert forkserver.startup_differences({**SERVER, **rank}, SERVER) == found


def test_a_forked_rank_names_itself_within_the_kernels_15_bytes() -> None:
    assert forkserver.name("3") == "hpc_ddp rank 3" and len(forkserver.name("99")) == 15


def test_only_training_ranks_are_forked() -> None:
    said: list[str] = []
    server = forkserver.Server("fake_ranks", said.append)
    assert server.start([], clean_environ(), hold=False) is None and said == []  # nothing to preload: plain


@pytest.mark.deadline(150)
def test_a_forked_rank_is_the_starters_child_and_exits_as_python_would(tmp_path) -> None:  # type: ignore[no-untyped-def]
    said: list[str] = []
    server = forkserver.Server("hpc_ddp.train", said.append)
    env = clean_environ(SLURM_PROCID="3", PYTHONUNBUFFERED="1")
    try:
        helped = server.start(["--help"], env, hold=False)
        assert helped is not None
        child = psutil.Process(helped.pid)
        # Reparented to the starter (a subreaper during the start), which reaps it; named for its rank.
        assert child.ppid() == os.getpid()
        assert child.name() == "hpc_ddp rank 3"
        out = helped.stdout.read().decode()
        assert helped.wait(timeout=60) == 0, out
        assert out.startswith("usage: python -m hpc_ddp.train"), out
        # A usage error: its one line on the rank's pipe (stderr and stdout both), exit code 2.
        refused = server.start(["--epochs", "0"], env, hold=False)
        assert refused is not None
        out = refused.stdout.read().decode()
        assert refused.wait(timeout=60) == exitcodes.USAGE, out
        assert "--epochs" in out and "Traceback" not in out
        # Another interpreter set-up: started the plain way, said once, and so are all later ranks.
        assert server.start(["--help"], {**env, "PYTHONPATH": str(tmp_path)}, hold=False) is None
        assert said == [
            "ranks start the plain way from now on (one `python -m hpc_ddp.train` each): this rank's "
            "environment differs from the fork server's in PYTHONPATH"
        ]
        assert server.start(["--help"], env, hold=False) is None and len(said) == 1
        # The server ended with its first refusal: nothing of it is left.
        servers = [p for p in psutil.Process().children() if "hpc_ddp.launch.local.forkserver" in p.cmdline()]
        assert servers == []
    finally:
        server.close()


@pytest.mark.deadline(150)
def test_a_forked_rank_sees_what_python_m_would_give_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "SERVED", ("forked_probe",))  # tests/forked_probe.py, in place of a rank
    said: list[str] = []
    server = forkserver.Server("forked_probe", said.append)
    env = clean_environ(SLURM_PROCID="1", PROBE="x")
    try:
        ranks = [
            server.start(["a", "b c"], env, hold=True),
            server.start([], {**env, "PROBE_EXIT": "3"}, hold=False),
            server.start([], {**env, "PROBE_EXIT": "no space left"}, hold=False),
        ]
        outs = []
        for rank in ranks:
            assert rank is not None
            outs.append(rank.stdout.read().decode())
        assert [rank.wait(timeout=60) for rank in ranks] == [0, 3, 1], outs  # type: ignore[union-attr]
    finally:
        server.close()
    seen = [json.loads(out.splitlines()[0]) for out in outs]
    assert [s["argv"] for s in seen] == [["a", "b c"], [], []]
    for s in seen:
        assert (s["cwd"], s["probe"], s["parent"], s["stdin"]) == (os.getcwd(), "x", os.getpid(), "/dev/null")
        assert s["session_leader"] and s["torch_imported"]
    held = {int(signum) for signum in processes.HELD}
    assert held <= set(seen[0]["blocked"]) and not held & set(seen[1]["blocked"])
    assert len({s["draw"] for s in seen}) == 3  # NumPy's global generator seeded anew in each, as when fresh
    assert all("to stderr" in out for out in outs)  # stderr is the same pipe
    assert outs[2].rstrip().endswith("no space left") and said == []
