"""Checkpoints on shared storage: the store, durable bytes, what a checkpoint may hold, formats, safe loading.

Layout of `<folder>/checkpoints/` (the rest of the run folder: hpc_ddp.run.folder):

    ckpt-00000120.pt   a checkpoint of the "full" format: one file, named by optimizer step
    ckpt-00000120/     a checkpoint that is a directory (a sharded format's: every rank writes its shards)
    latest             the name of the newest complete checkpoint, updated last

The modules, each one decision:

    storage    where checkpoints are written and read: the `Storage` interface, `Local` today  (no torch)
    store      names, `latest`, listing, rotation, stale temporaries, `latest_step`, the `CheckpointStore`
               (a run folder and its storage, built once per process, handed to every reader)  (no torch)
    durable    a file written atomically with its SHA-256, checksum files, why a write failed  (no torch)
    options    the checkpoint options, checked  (no torch)
    content    what a checkpoint may hold: `to_cpu`, `check_savable`, `require_finite`
    torchfile  one torch file: streamed into the storage, read back from it with weights_only (corrupt vs
               refused), its checksum checked through it
    writer     `AsyncWriter`: the background write, its retries (by time) and when to give up
    part       the `Part` interface: a named stateful part of a checkpoint
    format     the `Format` interface: a format owns its files (save, open, export, load_model, contents)
    formats    the formats installed, `format_of(path, storage)`, `find_resumable`
    full       the "full" format: rank 0 writes one file holding every part
    sharded    the "sharded" format: every rank writes its shards (Distributed Checkpoint)
    dcpwrite   how the shards reach DCP's files: the staging copy, `--async-save thread|process`
    streamed   a torch file written tensor by tensor (a sharded checkpoint's model exported)

And what a run does with them:

    checkpointer  saves and loads a run's named stateful parts through one format
    parts         the stateful parts of a run's checkpoint: model, optimizer, schedule, RNG, data position...
    resume        which checkpoint a run starts from, decided by global rank 0 and followed by every rank
    exact         what keeps a run from resuming bit for bit, known at start, said in one line (pure)

This package's `__init__` imports nothing: supervisors (the local launcher, the Slurm batch step) import
`hpc_ddp.run.checkpoint.store` for the step of the latest checkpoint without paying for torch.
"""
