"""The local launcher: N emulated nodes x T tasks on this machine, each task given what `srun` would give it.

Every child gets the SLURM_* variables of a real `srun --nodes N --ntasks-per-node T` step (a fresh fake job
id per run, node list `127.0.0.[1-N]`, which resolves everywhere without editing /etc/hosts, node/proc/local
ids and counts), so `hpc_ddp.dist.env.detect` takes its Slurm path: the same code as a cluster job.

The launcher supervises like Slurm with `--kill-on-bad-exit`: when a rank exits non-zero or dies, the others
are stopped within seconds and the launcher names the failed rank and prints the end of its log. Signals:
SIGUSR1/SIGUSR2 are passed to every rank, which save at an agreed step and exit PREEMPTED; the launcher then
plays Slurm's requeue and starts them again (SLURM_RESTART_COUNT+1) while `preempted.json` says so.
Every rank is told `--requeue-by launcher` (its fake job id is no Slurm job for scontrol to requeue).
SIGINT/SIGTERM are passed on too; the ranks save and the launcher does not restart. Children live in their
own session (a terminal's Ctrl-C reaches only the launcher, which forwards it once) and die with the launcher
even if it is SIGKILLed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from hpc_ddp import exitcodes
from hpc_ddp.dist.env import port_for_job, without_launcher
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.shape import JobShape
from hpc_ddp.proc import run as run_command
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig

GRACE_S = 3.0  # after a failure, survivors get SIGTERM, then SIGKILL after this long
TAIL_LINES = 15


@dataclass(frozen=True)
class LocalJob:
    nodes: int
    tasks_per_node: int
    folder: Path
    train_argv: list[str]
    max_requeue: int
    all_ranks: bool = False
    job_id: str = ""
    module: str = "hpc_ddp.train"
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def nodelist(nodes: int) -> str:
    return "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"


def slurm_env(job: LocalJob, rank: int, restarts: int) -> dict[str, str]:
    """The SLURM_* variables `srun --nodes N --ntasks-per-node T` gives task `rank` (pure)."""
    node, local = divmod(rank, job.tasks_per_node)
    hosts = nodelist(job.nodes)
    per_node = f"{job.tasks_per_node}(x{job.nodes})" if job.nodes > 1 else str(job.tasks_per_node)
    env = {
        "SLURM_JOB_ID": job.job_id, "SLURM_JOBID": job.job_id, "SLURM_JOB_NAME": "hpc_ddp-local",
        "SLURM_JOB_NODELIST": hosts, "SLURM_NODELIST": hosts, "SLURM_JOB_NUM_NODES": str(job.nodes),
        "SLURM_NNODES": str(job.nodes), "SLURM_NTASKS": str(job.world_size), "SLURM_NPROCS": str(job.world_size),
        "SLURM_TASKS_PER_NODE": per_node, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": hosts, "SLURM_STEP_NUM_NODES": str(job.nodes),
        "SLURM_STEP_NUM_TASKS": str(job.world_size), "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": f"127.0.0.{node + 1}", "SLURM_CPUS_ON_NODE": str(os.cpu_count() or 1),
    }
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)  # unset on the first run, as in Slurm
    return env


def child_environ(base: dict[str, str], job: LocalJob, rank: int, restarts: int) -> dict[str, str]:
    """The parent's environment minus any launcher variables it carries, plus this rank's fake srun step."""
    env = without_launcher(base)
    env.update(slurm_env(job, rank, restarts))
    env.update(job.extra_env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fresh_job_id() -> str:
    """A random fake job id whose derived port is free on loopback right now."""
    for _ in range(50):
        job_id = str(random.randint(1_000_000, 9_999_999))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port_for_job(job_id)))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port found for the local run in 50 tries")


def _die_with_parent(parent: int) -> None:
    # Runs in the child between fork and exec: SIGKILL us when the launcher dies, however it dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


class _Rank:
    """One child process, its log file and the tail of its output."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes], log_path: Path, console: TextIO,
                 show_all: bool) -> None:
        self.rank, self.proc, self.log_path = rank, proc, log_path
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.reader = threading.Thread(target=self._pump, args=(console, show_all), daemon=True)
        self.reader.start()

    def _pump(self, console: TextIO, show_all: bool) -> None:
        # The console shows rank 0's lines and the other ranks' own messages (start, end, warnings: the
        # lines hpc_ddp.log prefixes); everything, C++ warnings and tracebacks included, goes to the log file.
        prefix = "" if self.rank == 0 else f"[rank {self.rank}] "
        assert self.proc.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as log:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self.tail.append(line)
                if self.rank == 0 or show_all or line.startswith(prefix):
                    shown = line if line.startswith(prefix) else prefix + line
                    console.write(shown + "\n")
                    console.flush()


class Launcher:
    """Starts, supervises, signals and restarts the ranks of one local job."""

    def __init__(self, job: LocalJob, console: TextIO = sys.stdout) -> None:
        self.job, self.console = job, console
        self.ranks: list[_Rank] = []
        self.forwarded: list[int] = []  # signals the launcher received and passed on
        self.stop_requested = False

    def say(self, message: str) -> None:
        self.console.write(f"[launcher] {message}\n")
        self.console.flush()

    def _start(self, restarts: int) -> None:
        logs = self.job.folder / run_folder.LOGS
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-u", "-m", self.job.module, *self.job.train_argv]
        parent = os.getpid()
        self.ranks = []
        for rank in range(self.job.world_size):
            proc = subprocess.Popen(cmd, env=child_environ(dict(os.environ), self.job, rank, restarts),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=lambda: _die_with_parent(parent))
            self.ranks.append(_Rank(rank, proc, logs / f"rank{rank}.log", self.console, self.job.all_ranks))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.forwarded.append(signum)
        if signum in (signal.SIGINT, signal.SIGTERM):
            self.stop_requested = True
        # Ctrl-C becomes SIGTERM for the ranks: same "save and stop" path as scancel.
        child_signal = signal.SIGTERM if signum == signal.SIGINT else signum
        for r in self.ranks:
            if r.proc.poll() is None:
                try:
                    os.kill(r.proc.pid, child_signal)
                except ProcessLookupError:
                    pass

    def _stop_all(self) -> None:
        """SIGTERM the survivors, then SIGKILL whoever is still there after GRACE_S."""
        for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
            alive = [r for r in self.ranks if r.proc.poll() is None]
            for r in alive:
                try:
                    os.kill(r.proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive = [r for r in alive if r.proc.poll() is None]

    def _supervise(self) -> int | None:
        """Wait for all ranks; returns the first failure's rank index, or None if none failed."""
        while True:
            codes = [r.proc.poll() for r in self.ranks]
            failed = [i for i, c in enumerate(codes) if c not in (None, exitcodes.OK, exitcodes.PREEMPTED)]
            if failed:
                return failed[0]
            if all(c is not None for c in codes):
                return None
            time.sleep(0.05)

    def _report_failure(self, index: int) -> int:
        failed = self.ranks[index]
        code = failed.proc.returncode
        self._stop_all()
        for r in self.ranks:
            r.reader.join(timeout=5)
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        node = index // self.job.tasks_per_node
        self.say(f"rank {index} (node {node}, pid {failed.proc.pid}) {how}; stopped the other ranks. "
                 f"Last lines of {failed.log_path}:")
        for line in failed.tail:
            self.console.write(f"    {line}\n")
        self.console.flush()
        return exitcodes.USAGE if code == exitcodes.USAGE else exitcodes.FAILED

    def _restart_wanted(self) -> bool:
        record = run_folder.read_preempted(self.job.folder)
        return record is not None and record.requeue and not self.stop_requested

    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            restarts = 0
            while True:
                run_folder.clear_preempted(self.job.folder)
                self._start(restarts)
                failed = self._supervise()
                if failed is not None:
                    return self._report_failure(failed)
                for r in self.ranks:
                    r.reader.join(timeout=5)
                if all(r.proc.returncode == exitcodes.OK for r in self.ranks):
                    return exitcodes.OK
                if not self._restart_wanted() or restarts >= self.job.max_requeue:
                    self.say(f"ranks stopped after saving a checkpoint in {self.job.folder}; run the same "
                             "command to resume")
                    return exitcodes.PREEMPTED
                restarts += 1
                self.say(f"preempted: restarting all ranks ({restarts} of --max-requeue {self.job.max_requeue})")
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)


def gpu_count() -> int:
    """GPUs on this machine, without importing torch (nvidia-smi, else 0)."""
    out = run_command(["nvidia-smi", "-L"], timeout_s=10).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def run_local(shape: JobShape, cfg: TrainConfig, all_ranks: bool, module: str,
              extra_argv: tuple[str, ...] = ()) -> int:
    """`python -m hpc_ddp.submit --local`: prepare the run folder, start the ranks here, supervise them."""
    if cfg.requeue_by == "scontrol":
        raise UsageError("--requeue-by scontrol: a local run is no Slurm job that scontrol could requeue; its "
                         "launcher restarts it after a preemption. Fix: drop --requeue-by")
    # Said explicitly to every rank: there is no real Slurm job to requeue (its job id is fake), so after a
    # preemption the ranks exit PREEMPTED and this launcher starts them again (see Launcher.run).
    cfg = dataclasses.replace(cfg, requeue_by="launcher")
    job_id = fresh_job_id()
    folder = Path(cfg.folder) if cfg.folder else run_folder.default_for_local_run(job_id)
    run_folder.prepare(folder)
    (folder / run_folder.LOGS).mkdir(exist_ok=True)
    cfg = cfg.with_folder(str(folder))
    extra = {}
    if shape.gpus_per_node > 0:
        have = gpu_count()
        if have < shape.nodes * shape.gpus_per_node:
            print(f"[launcher] --gpus-per-node {shape.gpus_per_node} x {shape.nodes} nodes asked, this machine has "
                  f"{have} GPU(s): running {shape.tasks_per_node} CPU processes per node with gloo instead",
                  flush=True)
            extra["CUDA_VISIBLE_DEVICES"] = ""
    job = LocalJob(nodes=shape.nodes, tasks_per_node=shape.tasks_per_node, folder=folder,
                   train_argv=cfg.to_argv() + list(extra_argv), max_requeue=cfg.max_requeue,
                   all_ranks=all_ranks, job_id=job_id, module=module, extra_env=extra)
    print(f"[launcher] local job {job_id}: {shape.nodes} nodes x {shape.tasks_per_node} processes, run folder "
          f"{folder}, per-rank logs in {folder / run_folder.LOGS}", flush=True)
    return Launcher(job).run()
