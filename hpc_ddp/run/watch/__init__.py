"""The hang watch: notice a stalled rank within seconds, name the culprit while every rank is alive, end.

watchdog    the watchdog thread of each rank, and what it does once a limit passes
beacon      what this rank is doing, and since when: the progress beacon the watchdog reads
verdict     from the reports of the ranks that still answer, one line that names the culprit
stragglers  one rank slower than the others: measure, compare, name
longwork    `hpc_ddp.long_work`: mark long legitimate work in the task's own code
options     the process group's backend and timeout, --hang-timeout-s (no runtime code)
"""
