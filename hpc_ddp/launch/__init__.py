"""The launch layer: how the tasks of a job are started, and how their end is reported.

`shape` is the job's size (nodes x tasks), `local` the launcher that runs them on this machine as srun would,
`slurm` builds, submits and follows the same job on a Slurm cluster. Every path ends in the same task:
`python -m hpc_ddp.train` (or `hpc_ddp.doctor`), which derives everything else from its environment. Every
end of an attempt goes through `supervisor` (with the ledger's judge and its one decision: hpc_ddp.ledger.judge, hpc_ddp.ledger.decision), whichever supervises it: the
local launcher, or the batch shell's steps around srun (`slurm/batch`).
"""
