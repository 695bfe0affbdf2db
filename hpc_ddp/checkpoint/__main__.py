"""python -m hpc_ddp.checkpoint export <checkpoint> <out.pth>

Writes the model of a checkpoint (sharded: a `ckpt-<step>/` folder, read in this one process whatever the
number of ranks that wrote it; or full: a `ckpt-<step>.pt` file) as the bare model's plain state dict, the file
`model.pth` is at the end of a run: loadable with `torch.load(path, weights_only=True)` into the user's model,
its SHA-256 in `<out.pth>.sha256`. The checkpoint's checksums are verified first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    ns = parser.parse_args(argv)
    try:
        size = run_export(ns.checkpoint, ns.out)
    except UsageError as e:  # CheckpointError and its kinds: one line, exit 2
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out} ({size} bytes) from {ns.checkpoint}")
    return 0


def run_export(checkpoint: Path, out: Path) -> int:
    from hpc_ddp.errors import CheckpointError
    from hpc_ddp.run.checkpoint import full, sharded, store, torchfile

    if not checkpoint.exists():
        raise UsageError(
            f"{checkpoint}: no such checkpoint. Give a ckpt-<step>/ folder or ckpt-<step>.pt file"
        )
    checkpoint = store.resolve(checkpoint)  # checkpoints/best, checkpoints/latest: the checkpoint each names
    if checkpoint.is_dir():
        return sharded.export(checkpoint, out)
    state = full.load(checkpoint)
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"checkpoint {checkpoint} holds no model state")
    return torchfile.atomic_save(state["model"], out)


if __name__ == "__main__":
    sys.exit(main())
