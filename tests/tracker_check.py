"""Read back what the experiment trackers logged offline (tests of --tracker): wandb's offline runs and an
MLflow file store, with the packages' own reader where they have one.

wandb keeps an offline run in `<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`: LevelDB's log format (32 KiB
blocks of records, each a 7-byte header: CRC32C, length, type) after a 7-byte header of its own (":W&B", a
magic number, a version), each record a `wandb_internal_pb2.Record`. Its Python reader left the package when
its core moved to Go; `wandb_records` reads the format, and the protobuf classes are the package's own.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    """Every record of one offline run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file ({data[:7]!r})"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            chunks.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            chunks.append(pending + chunk)
    records = []
    for raw in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def wandb_run(run_file: Path) -> dict[str, Any]:
    """One offline start: its run id, its config keys, each history row's {key: value} and its summary."""
    found: dict[str, Any] = {"id": None, "config": {}, "history": [], "summary": {}}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["id"] = record.run.run_id
            found["config"].update({i.key: i.value_json for i in record.run.config.update if i.key})
        elif kind == "config":
            found["config"].update({i.key: i.value_json for i in record.config.update if i.key})
        elif kind == "history":
            found["history"].append(
                {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            )
        elif kind == "summary":
            found["summary"].update(
                {i.key or "/".join(i.nested_key): i.value_json for i in record.summary.update}
            )
    return found
