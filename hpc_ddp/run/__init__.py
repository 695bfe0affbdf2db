"""The run layer: one rank's training run, from its options to its last checkpoint.

`config` holds the training options, `session` is what one task does (detect, place, join, train, save),
`trainer` the DDP loop, `checkpoint`/`resume` the saved state, `preemption` the agreed stop, `folder` the run
folder's layout, `metrics` and `record` what a run writes about itself, `tasks` what it trains. It knows the
distributed layer below it and nothing about how the job was launched.
"""
