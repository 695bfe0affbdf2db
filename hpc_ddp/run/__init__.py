"""The run layer: one rank's training run, from its options to its last checkpoint.

Its rooms, each a folder with its own index:

    loop/        the step and the loop: the trainer, the step's all-reduce, stops, schedules, evaluation
    data/        the training data: feed, loaders, streams, per-batch seeding, DataLoader workers
    checkpoint/  the saved state: formats, storage, the checkpointer, the parts, which checkpoint a run resumes
    records/     what a run writes about itself: metrics.jsonl, the progress line, step.json, run.json, TensorBoard
    watch/       the hang watchdog, the beacon, the verdict, stragglers
    strategy/    how the model is spread over the ranks: DDP or FSDP (entry point group `hpc_ddp.strategies`)
    sinks/       the experiment trackers (`hpc_ddp.sinks`)
    snapshot/    snapshots in memory (--snapshot-every-steps): recovery with at most one step lost

And at its door: `session` (what one task does: detect, place, join, train, save), `config` and `options`
(the training options, a part per concern, each beside its code; `configfile` for `--config`), `tasks`,
`taskspec` and `taskargs` (what to train and the task's own settings), `callbacks` (the user's hooks),
`folder` (the run folder's layout), `startup`, `memory` and `quiet` (a rank's start: torch's import, the
allocator, warnings). It knows the distributed layer below it and nothing about how the job was launched.
Each room's `__init__` imports nothing: a supervisor that reads one module of it pays for nothing else.
"""
