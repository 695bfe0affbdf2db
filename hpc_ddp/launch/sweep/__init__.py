"""Sweeps: many trials of one run, one command, resumable, nothing run twice (docs/sweeps.md).

spec      --sweep NAME=V1,V2 and --sweep-file, as text (pure)
trials    each trial checked as the run it is by the run's own parser, and named (its folder)
state     where each trial stands, which to (re)run, the sweep's record (sweep.json)
options   the sweep's flags of hpc_ddp.submit
command   the whole of `submit --sweep`: check everything, then start
local     --local: the trials here, one or --sweep-parallel P at a time
"""
