"""The ledger: what the ranks and their supervisors leave for each other in the run folder, in one place.

Both sides import it (the ranks in `hpc_ddp.run`, the supervisors in `hpc_ddp.launch`), so it sits below both,
and needs no torch:

    attempts.jsonl      every attempt's start (rank 0) and end (its supervisor)      ledger.attempts
    exits/<job>-<n>/    what each rank that raised left for its supervisor          ledger.exits
    preempted.json      the facts of a preemption: signal, votes, step (rank 0)      ledger.preemption
    hang.json           the hang verdict (written by the watchdog through this)      ledger.verdict

and the words they share: the outcomes of an attempt, what comes after one, and the exit code of each
(ledger.outcomes); the error signature that tells one error from another (ledger.signature); the atomic file
writes everything here is written with (ledger.files). And the one judge of them, pure: how an attempt (or a
job `submit --wait` followed) ended, its first cause and whom to blame (ledger.judge, with ledger.faults: an
error's blame), and what the job does next, its budgets each one rule (ledger.rules).
"""
