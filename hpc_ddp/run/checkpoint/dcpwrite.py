"""How a sharded checkpoint's tensors reach DCP's files (`--async-save thread|process`), and the staging copy
they are written from.

Staging (`Staging`, on the training thread: the loop's stall): DCP's stager copies this rank's shards to CPU
memory; training may then change its own at once. The copy is made into the same buffers every save (DCP's
stager keeps, per tensor it staged, the copy it made), so a run holds one staging copy, allocated once, instead
of a new one per save; the next save's staging first waits until the previous save's first write attempt
has ended. With `process`, the buffers are in shared memory, so that the saving process reads them without a
copy.

Writing (on the rank's background writer thread, hpc_ddp.run.checkpoint.writer):
- `thread`: `dcp.save` runs on that thread, in this process: its serialisation and file writes compete with
  the training thread for the interpreter (the GIL) while they last.
- `process` (DCP's `AsyncCheckpointerType.PROCESS`): each rank has a process of DCP's own that writes its
  shards; the writer thread only waits for it. At the first save DCP spawns it (a fresh interpreter that
  imports torch: seconds, once) and the saving processes of all ranks join a gloo group of their own. They
  meet at a TCP store rank 0 opens at start on a port the system picks (bound at once and held for the run,
  so nothing else can take it; DCP's default instead finds a free port, closes it and binds it again later
  in another process, a race with anything else on the node). The kit's derived ports (cluster/env.py) stay
  the training group's alone. A saving process ends when its rank does: DCP stops it on a normal exit, and a
  rank that dies leaves it watching for that (`in_saving_process`, run by hpc_ddp.train in the spawned
  interpreter), since a process started from a thread cannot use PR_SET_PDEATHSIG; the stop signals Slurm
  sends every process of a step are its rank's to act on, and it ignores them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpc_ddp.run.checkpoint.storage import Storage

ASYNC_SAVES = ("thread", "process")
# DCP's storage layers by the name a Storage gives (Storage.dcp_layer): its writer and reader classes. An fsspec
# storage would add "fsspec": torch.distributed.checkpoint._fsspec_filesystem's FsspecWriter, FsspecReader.
DCP_LAYERS = {"filesystem": ("torch.distributed.checkpoint", "FileSystemWriter", "FileSystemReader")}
PARENT_POLL_S = 0.5  # how often a saving process checks that its rank is alive


# Signals a saving process ignores: they are its rank's to act on. Slurm signals every process of a step (a
# preemption's USR1/USR2, the time limit's TERM), and each would end a fresh interpreter at once, with the save
# its rank stops for still to write.
IGNORED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def in_saving_process(poll_s: float = PARENT_POLL_S) -> None:
    """In a process a rank spawned (DCP's saving process), before anything else is imported (no torch here):
    leave the stop signals to the rank (IGNORED), exit at once when that rank is gone (checked every `poll_s`
    on a daemon thread), and keep DCP's progress lines (it logs every request at INFO on the root logger) out
    of the rank's log; its errors stay."""
    import logging

    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    logging.getLogger().addFilter(lambda record: record.levelno >= logging.WARNING)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="hpc_ddp-exit-with-rank", daemon=True).start()


def storage_writer(storage: Storage, path: str) -> Any:
    """DCP's StorageWriter for directory `path` of `storage`."""
    module, writer, _ = DCP_LAYERS[storage.dcp_layer]
    return getattr(importlib.import_module(module), writer)(path)


def storage_reader(storage: Storage, path: str) -> Any:
    """DCP's StorageReader for directory `path` of `storage`."""
    module, _, reader = DCP_LAYERS[storage.dcp_layer]
    return getattr(importlib.import_module(module), reader)(path)


class Staging:
    """This rank's CPU copy of its shards, reused by every save whose previous write succeeded (see the module
    docstring). A write that failed may be retried from its copy later (writer.py): the next save then copies
    into new buffers, and the failed one's stay with its job until a newer save supersedes it."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared  # in shared memory: for a saving process to read
        self.stager: Any = None
        self.staged = 0  # generations: the copies made, and the newest one written
        self.written = 0
        self.attempt_over = threading.Event()  # the newest copy's first write attempt has ended
        self.attempt_over.set()

    def stage(self, tensors: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """A copy of `tensors` (DTensors stay DTensors, on CPU), and its generation for `over()`."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.attempt_over.wait()  # back-pressure: the previous save's write reads its copy until it ends
        if self.stager is None or self.written != self.staged:
            # Pinned memory, shared memory, asynchronous staging, non-blocking copies.
            self.stager = DefaultStager(StagingOptions(False, self.shared, False, False))
        staged: dict[str, Any] = self.stager.stage(dict(tensors))
        self.staged += 1
        self.attempt_over.clear()
        return self.staged, staged

    def release(self) -> None:
        """Free the buffers (the next save, if any, allocates new ones)."""
        self.stager = None
        self.written = self.staged  # nothing left that a retry could read

    def over(self, generation: int, written: bool) -> None:
        """On the writer thread, after each attempt's DCP write of copy `generation` (`written`: it succeeded)."""
        if written:
            self.written = max(self.written, generation)
        self.attempt_over.set()


class _AsStaged:
    """An AsyncStager for dcp.async_save that keeps the state as it is: it is staged already."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadWrite:
    """`--async-save thread`: dcp.save on the writer thread, over the writers' own gloo group, into the run's
    storage (hpc_ddp.run.checkpoint.storage: DCP's writer for it)."""

    def __init__(self, env: Any, group: Any, storage: Storage) -> None:
        self.env, self.group, self.storage = env, group, storage

    def write(self, staged: dict[str, Any], folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(staged, storage_writer=storage_writer(self.storage, str(folder)), process_group=self.group)

    def close(self) -> None:
        pass


# What DCP's saving processes read to find each other (its _ProcessGroupInitInfo, on the writer thread when the
# first save starts one): the store rank 0 opened, under a key prefix of DCP's own.
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "DCP_USE_PREFIX_STORE")


class ProcessWrite(ThreadWrite):
    """`--async-save process`: each rank's shards written by a saving process of DCP's own. A collective at
    start (every rank): rank 0 opens the saving processes' store and every rank learns its port."""

    def __init__(self, env: Any, group: Any, storage: Storage) -> None:
        import torch.distributed as dist

        super().__init__(env, group, storage)
        self.store: Any = None
        port = [0]
        if env.is_main:
            # Port 0: the system picks a free one and the store holds it from now on (see the docstring).
            self.store = dist.TCPStore(
                env.master_addr, 0, env.world_size, is_master=True, wait_for_workers=False
            )
            port[0] = self.store.port
        dist.broadcast_object_list(port, src=0, group=group)
        self.rendezvous = {
            "MASTER_ADDR": env.master_addr,
            "MASTER_PORT": str(port[0]),
            "DCP_USE_PREFIX_STORE": "1",
        }

    def write(self, staged: dict[str, Any], folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        with _environ(self.rendezvous):
            future = dcp.async_save(
                staged,
                storage_writer=storage_writer(self.storage, str(folder)),
                process_group=self.group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=_AsStaged(),
            )
        future.result()  # the saving process's answer: its metadata, or the exception it met, raised here

    def close(self) -> None:
        """Stop this rank's saving process, if it was started: asked to end, then SIGTERM after 5 s. DCP has no
        public call for this; its own finalizer does the same at interpreter exit, which a rank's os._exit
        skips (the process would then end only on the closed pipe, with a traceback in the rank's log)."""
        from torch.distributed.checkpoint import _async_process_executor as executor

        saver, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        if saver is not None:
            with contextlib.suppress(Exception):  # already gone: nothing to stop
                saver.__del__()
            if saver._save_process.is_alive():  # it ignores DCP's SIGTERM (IGNORED): not its rank's exit
                saver._save_process.kill()


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block, then as they were (DCP reads its rendezvous from there)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def writer(kind: str, env: Any, group: Any, storage: Storage) -> ThreadWrite:
    """The write of `--async-save kind`, over `group` (a collective for `process`), into `storage`."""
    return ProcessWrite(env, group, storage) if kind == "process" else ThreadWrite(env, group, storage)
