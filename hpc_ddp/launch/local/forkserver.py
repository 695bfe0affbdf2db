"""Start a local run's training ranks by forking them from one process that imported torch once.

Importing torch, torch._dynamo and torch.distributed is nearly all of a rank's start-up (hpc_ddp.run.startup:
about 2.5 CPU seconds on this project's 2-core test machine), and every rank of every attempt paid it: a 2 x 2
run that is preempted twice imported torch twelve times. The launcher stays torch-free (its `--help` and its
one-line refusals answer at once), so it starts one server per run instead: `python -m
hpc_ddp.launch.local.forkserver`, which imports torch once, and the kit's modules a rank imports (startup.import_rank:
the collector paused, then `gc.freeze()`, so forked ranks share those pages instead of copying them; the kit's
modules are plain ones, tests/test_architecture.py) and then forks every rank the launcher
asks for, across restarts. This is Python's multiprocessing "forkserver" with a preload, and how PyTorch's
DataLoader workers start: forked from a process that imported torch. The server itself never runs a torch
operation (no thread pool, no CUDA context exists to be forked).

A forked rank sees what `python -u -m hpc_ddp.train ARGS` with its environment would see:

- the launcher is its parent. The server forks a short-lived middle process, which forks the rank and exits;
  the kernel then hands the rank to the nearest ancestor marked a child subreaper, which the launcher is for
  the length of a start (`subreaper`). So the launcher reaps it, signals it and reads its exit status as for a
  process it started itself (`Forked`), and PR_SET_PDEATHSIG is set once that is so.
- its own session; stdout and stderr the launcher's pipe; stdin /dev/null; the launcher's working directory;
  `sys.argv` as `-m` sets it; SIGUSR1/SIGUSR2/SIGTERM blocked until the rank handles them (processes.HELD);
- its environment, set before anything of the kit is imported. torch read the server's at import; a rank's
  differs from it only by what the launcher adds (SLURM_*, the kit's variables, CUDA_VISIBLE_DEVICES, which
  CUDA reads at its first use, never at import). A rank whose environment differs in anything an interpreter
  or torch reads at start-up (`STARTUP_PREFIXES`) is started the plain way, as is every rank when the server
  cannot start or answer: `start` returns None and says why (processes.start is the fallback).

What differs, seen from outside: `ps` shows the server's command line for every rank (`python -u -m
hpc_ddp.launch.local.forkserver hpc_ddp.train`) and /proc/PID/environ the server's environment, both fixed at
exec; so a forked rank names itself (`ps -o pid,comm`, top, psutil's name(): "hpc_ddp rank 3"). Ranks forked
from one server also share its hash seed.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from hpc_ddp.cluster.env import SLURM_PREFIX, SLURM_VARS
from hpc_ddp.launch.local import processes

# Modules whose ranks are forked (they import torch first thing); any other runs the plain way.
SERVED = ("hpc_ddp.train",)
# Environment variables an interpreter or torch reads when it starts or imports: a rank whose value differs
# from the server's must be started the plain way. PYTHONUNBUFFERED is the exception: the server runs `-u`.
# LANG and LC_*: the encoding of the standard streams, which the server opened at its start for every rank.
STARTUP_PREFIXES = (
    "PYTHON",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS",
    "LD_",
    "MALLOC",
    "LANG",
    "LC_",
    "GLIBC_",
)
ANSWER_S = 300.0  # the server's first answer waits for its import of torch: seconds under a loaded machine
REPARENT_S = 10.0  # a forked rank waits this long at most for the launcher to become its parent
_MESSAGE = 1 << 20  # the largest request (an environment) the server reads


def startup_differences(server: Mapping[str, str], rank: Mapping[str, str]) -> list[str]:
    """The start-up variables (STARTUP_PREFIXES) whose values differ between two environments (pure)."""
    names = {n for n in (*server, *rank) if n.startswith(STARTUP_PREFIXES) and n != "PYTHONUNBUFFERED"}
    return sorted(n for n in names if server.get(n) != rank.get(n))


def name(rank: str) -> str:
    """What a forked rank calls itself (the kernel keeps 15 bytes: up to rank 99 whole)."""
    return f"hpc_ddp rank {rank}"


@contextmanager
def subreaper() -> Iterator[None]:
    """Mark this process a child subreaper while the block runs: an orphan below it comes to it, not to init."""
    if processes.prctl(processes.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    try:
        yield
    finally:
        processes.prctl(processes.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class Forked:
    """A forked rank, seen from the launcher (its parent): the part of subprocess.Popen the launcher uses."""

    def __init__(self, pid: int, stdout: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.stdout = os.fdopen(stdout, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours to reap: never happens while the launcher is its parent
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]  (poll set it)


class Server:
    """The launcher's end: one server per run, started at the first rank, ended with the launcher."""

    def __init__(self, module: str, say: Callable[[str], None]) -> None:
        self.module = module
        self._say = say  # the launcher's console line
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}
        self._broken = module not in SERVED  # once broken, every later rank starts the plain way

    def _fail(self, why: str) -> None:
        if not self._broken:
            self._say(f"ranks start the plain way from now on (one `python -m {self.module}` each): {why}")
        self._broken = True
        self.close()

    def _open(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._env = dict(env)
        parent = os.getpid()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", "-m", __name__, self.module, str(theirs.fileno())],
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # a rank's is its pipe; the server's own errors go to stderr
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only, as for the ranks
                preexec_fn=lambda: processes.die_with_parent(parent),
            )
        finally:
            theirs.close()
        ours.settimeout(ANSWER_S)
        self._sock = ours

    def start(self, args: Sequence[str], env: Mapping[str, str], hold: bool) -> Forked | None:
        """Fork one rank (`python -u -m MODULE args` with `env`), or None: start it the plain way."""
        if self._broken:
            return None
        if self._sock is None:
            # The server gets the first rank's environment minus its own rank's variables: whatever it reads
            # at start-up is then what every rank would have read.
            try:
                self._open({k: v for k, v in env.items() if not k.startswith(SLURM_PREFIX)})
            except OSError as e:
                self._fail(f"the fork server did not start ({e})")
                return None
        differ = startup_differences(self._env, env)
        if differ:
            self._fail(f"this rank's environment differs from the fork server's in {', '.join(differ)}")
            return None
        assert self._sock is not None
        read, write = os.pipe()
        request = {
            "args": list(args),
            "env": dict(env),
            "cwd": os.getcwd(),
            "hold": hold,
            "parent": os.getpid(),
        }
        try:
            with subreaper():
                socket.send_fds(self._sock, [json.dumps(request).encode()], [write])
                os.close(write)
                write = -1
                answer = json.loads(self._sock.recv(_MESSAGE) or b"{}")
        except (OSError, ValueError) as e:
            for fd in (read, write):
                if fd >= 0:
                    os.close(fd)
            self._fail(f"the fork server did not answer ({e or type(e).__name__})")
            return None
        if "pid" not in answer:
            os.close(read)
            self._fail(f"the fork server could not start a rank ({answer.get('error', 'it ended')})")
            return None
        return Forked(int(answer["pid"]), read, [sys.executable, "-u", "-m", self.module, *args])

    def close(self) -> None:
        """End the server; its ranks are the launcher's children and go on. It holds nothing that needs an
        orderly exit (no file, no lock; its interpreter's teardown would only cost the launcher's end time)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


# ----- the server's side ----------------------------------------------------------------------------------------


def _serve(module: str, sock: socket.socket) -> None:
    from hpc_ddp.run import startup

    startup.import_rank()  # once, for every rank of the run: torch, and the kit's modules a rank imports
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MESSAGE, 1)
        except OSError:
            return
        if not data:
            return  # the launcher closed its end: the run is over
        answer: dict[str, object]
        try:
            answer = {"pid": _spawn(module, json.loads(data), fds[0], sock)}
        except Exception as e:  # noqa: BLE001  (said to the launcher, which starts the rank the plain way)
            answer = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(answer).encode())


def _spawn(module: str, request: dict, out: int, sock: socket.socket) -> int:
    """Fork a middle process, which forks the rank, waits until the rank has its own session (and, with `hold`,
    its held signals blocked: what a rank started by Popen has before Popen returns), writes the rank's pid and
    exits. The rank is then the launcher's child, and whatever the launcher sends it from then on lands as it
    would on a rank it started itself. Returns the rank's pid."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            if request["hold"]:  # inherited by the rank: pending until preemption.install() has set handlers
                signal.pthread_sigmask(signal.SIG_BLOCK, processes.HELD)
            ready, done = os.pipe()
            rank = os.fork()
            if rank == 0:
                os.close(write)
                os.close(ready)
                _become_rank(module, request, out, sock, done)  # never returns
            os.close(done)
            os.read(ready, 1)  # end of file: the rank leads its own session now (or died)
            os.write(write, str(rank).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        pid = pipe.read()
    os.waitpid(middle, 0)  # it has exited: its child now has the launcher (the subreaper) as parent
    if not pid:
        raise OSError("the middle process could not fork the rank")
    return int(pid)


def _become_rank(module: str, request: dict, out: int, sock: socket.socket, done: int) -> None:
    code = 1
    try:
        sock.close()
        # Before the launcher learns the pid: it signals the rank's process group by it, and tells ranks by name.
        os.setsid()
        rank = name(request["env"].get(SLURM_VARS["rank"][0], "?"))
        processes.prctl(processes.PR_SET_NAME, ctypes.c_char_p(rank.encode()), 0, 0, 0)
        os.close(done)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        parent = int(request["parent"])
        deadline = time.monotonic() + REPARENT_S
        while os.getppid() != parent:  # the middle process is exiting
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.001)
        processes.die_with_parent(parent)  # its held signals are blocked already (_spawn)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # A fresh interpreter seeds NumPy's global generator from the OS (torch imports numpy.random); forked
        # ranks would all draw the server's numbers until the run seeds them. Python's `random` reseeds itself
        # after a fork; torch's default generator starts from the same fixed seed in every process anyway.
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()
        code = _run(module, request["args"])
    except BaseException:  # noqa: BLE001  (setting the rank up failed: say why on its output, exit 1)
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run(module: str, args: list[str]) -> int:
    """Run `module` as `python -m` would, and what the interpreter does at its exit; the exit code."""
    import atexit
    import runpy
    import threading

    sys.argv = [module, *args]  # runpy puts the module's path first, as -m does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (printed as the interpreter would, exit code 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  (the interpreter's own wait for non-daemon threads)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
    return code


def main(argv: Sequence[str]) -> None:
    module, fd = argv[0], int(argv[1])
    _serve(module, socket.socket(fileno=fd))


if __name__ == "__main__":
    main(sys.argv[1:])
