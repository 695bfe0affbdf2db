"""python -m hpc_ddp.checkpoint export [--checkpoint-storage NAME] [--checkpoint-format NAME] <checkpoint> <out>

Writes the model of a checkpoint (sharded: a `ckpt-<step>/` folder, read in this one process whatever the
number of ranks that wrote it; or full: a `ckpt-<step>.pt` file) as the bare model's plain state dict, the file
`model.pth` is at the end of a run: loadable with `torch.load(path, weights_only=True)` into the user's model,
its SHA-256 in `<out.pth>.sha256`. The checkpoint's checksums are verified first. The checkpoint's own format
writes the file (hpc_ddp.run.checkpoint.formats); both are read and written through the storage the run's
--checkpoint-storage named.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_ddp import registry
from hpc_ddp.errors import UsageError

PROG = "python -m hpc_ddp.checkpoint"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a checkpoint's model as a plain model.pth")
    export.add_argument(
        "checkpoint",
        type=Path,
        help="ckpt-<step>/ (sharded) or ckpt-<step>.pt (full), or a run's checkpoints/best or checkpoints/latest",
    )
    export.add_argument("out", type=Path, help="the .pth file to write")
    export.add_argument(
        "--checkpoint-storage",
        default="local",
        metavar="NAME",
        help=f"where the run kept its checkpoints: its --checkpoint-storage (installed: {registry.storages.help()})",
    )
    export.add_argument(
        "--checkpoint-format",
        default="auto",
        metavar="NAME",
        help="the run's --checkpoint-format, when it is a plugin's (auto: the first format installed that owns the "
        f"checkpoint; installed: {registry.checkpoint_formats.help()})",
    )
    ns = parser.parse_args(argv)
    try:
        size = run_export(ns.checkpoint, ns.out, ns.checkpoint_storage, ns.checkpoint_format)
    except UsageError as e:  # CheckpointError and its kinds: one line, exit 2
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out} ({size} bytes) from {ns.checkpoint}")
    return 0


def run_export(checkpoint: Path, out: Path, storage_name: str, format_name: str = "auto") -> int:
    from hpc_ddp.checkpoint import found
    from hpc_ddp.run.checkpoint import store

    storage = store.storage_named(storage_name)
    path, fmt = found(checkpoint, storage, format_name)
    return fmt.export(path, out, storage)


if __name__ == "__main__":
    sys.exit(main())
