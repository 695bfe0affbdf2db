"""What a run writes about itself, for people and for the supervisors: progress, records, `run.json`, curves.

    metrics       rank 0's view of progress: the live line, periodic log lines, `metrics.jsonl` (every field)
    metrics_read  reading `metrics.jsonl` back
    progress      the progress line: one text for a step, wherever a person looks at it
    reached       `step.json`: the last step rank 0 finished, for the supervisor that ends an attempt
    record        `run.json`: what ran, with which settings and versions
    tblog         `--tensorboard`: the run's scalars, one curve per tag across every start

The trackers (`--tracker`, entry point group `hpc_ddp.sinks`) are in run/sinks.
"""
