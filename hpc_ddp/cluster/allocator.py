"""The host memory allocator settings every rank the kit starts runs with: glibc malloc's tunables, given by
the environment when the rank's interpreter starts (`GLIBC_TUNABLES`; glibc reads it once, at exec).

    glibc.malloc.mmap_threshold=4194304   a block of 4 MiB or more gets its own mapping, returned to the system
                                          the moment it is freed (glibc's default starts at 128 KiB and rises
                                          to the size of the largest block freed, up to 32 MiB; blocks below it
                                          come from heaps that keep what is freed, and fragment)
    glibc.malloc.hugetlb=1                those mappings are asked for transparent huge pages (madvise): a
                                          16 MiB block then costs 8 page faults instead of 4,096

Why: FSDP frees and reallocates each block's gathered parameters and gradients every step. With glibc's
defaults those blocks come from the heap once the threshold has risen to their size, and the sharded
gradients and optimizer state allocated between them fragment it: a rank's resident memory grows step after
step to several times what it holds (`python -m hpc_ddp.bench fsdp`: 100 M parameters, 4 CPU ranks, fsdp 2.6 to
3.0 GB a rank, ddp 4.2 GB; with these settings fsdp 1.1 GB, at the same speed relative to ddp). A fixed
threshold alone returns the memory but makes every gather fault in fresh pages (fsdp 2.5 times slower); huge
pages take most of that cost away. On GPUs it only touches the host side (staging copies, data), where it
returns memory as promptly.

Who applies it: the local launcher (each rank and the fork server it forks them from), `submit` (the
environment sbatch exports into the job) and `slurm/ddp.sbatch` (an `export` with this same value, checked by
tests/test_run_memory.py). A GLIBC_TUNABLES already in the environment is left as it is (an empty one: glibc's
defaults); ranks started otherwise (torchrun, a plain `python -m hpc_ddp.train`) get what their environment
says. Older glibc ignores tunables it does not know; without THP (`never`) the madvise does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

VAR = "GLIBC_TUNABLES"
SETTINGS = "glibc.malloc.mmap_threshold=4194304:glibc.malloc.hugetlb=1"


def for_ranks(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to a rank's environment (pure): the kit's settings, unless GLIBC_TUNABLES is set there."""
    return {} if VAR in environ else {VAR: SETTINGS}
