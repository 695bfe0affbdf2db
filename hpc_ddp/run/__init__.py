"""The run layer: one rank's training run, from its options to its last checkpoint.

`config` holds the training options (a part per concern, each beside its code), `session` is what one task
does (detect, place, join, train, save), `trainer` the loop (through a `strategy`: DDP or FSDP), `checkpoint`/
`checkpointer`/`resume` the saved state, `preemption` the agreed stop, `folder` the run folder's layout,
`metrics`, `sinks` and `record` what a run writes about itself, `tasks` what it trains. It knows the
distributed layer below it and nothing about how the job was launched.
"""
