"""Snapshots in memory: lose at most one step when a rank or a node is lost (issue 45; docs/memory.md).

Every `--snapshot-every-steps N` optimizer steps each rank copies its whole resumable state (the same parts the
disk checkpoint holds) into its node's memory, `$HPC_DDP_SNAPSHOT_DIR/<job id>/<node name>/` (default
`/dev/shm/hpc_ddp`), and sends one replica to a buddy rank on another node, which keeps it in its own node's
memory. A restart of the same job resumes from the newest snapshot every rank of the new start can reach (its
node's own copy, else a buddy's replica, sent to it), when it is newer than the disk's checkpoint. The disk
stays the durable layer: a snapshot is never a checkpoint of record.

The modules, each one decision:

    options    --snapshot-every-steps, --snapshot-memory-limit, checked  (no torch)
    store      the node's folder: names, two generations, checksummed files renamed into place, the
               inventory of what a node holds, cleanup  (no torch)
    plan       which snapshot a restart resumes from, and who sends which rank its state  (no torch)
    taker      the loop's side: the copy out of the tensors, then the write and the buddy's replica on a
               thread of their own, over a gloo group of their own
    recover    the restart's side: the inventory gathered, the plan followed, the state loaded
"""
