"""The host memory allocator settings every rank the kit starts runs with: glibc malloc's tunables, given by
the environment when the rank's interpreter starts (`GLIBC_TUNABLES`; glibc reads it once, at exec).

    glibc.malloc.mmap_threshold=4194304   a block of 4 MiB or more gets its own mapping, returned to the system
                                          the moment it is freed (glibc's default starts at 128 KiB and rises
                                          to the size of the largest block freed, up to 32 MiB; blocks below it
                                          come from heaps that keep what is freed, and fragment)
    glibc.malloc.hugetlb=1                those mappings are asked for transparent huge pages (madvise): a
                                          16 MiB block then costs 8 page faults instead of 4,096

Whose: the strategy's. FSDP frees and reallocates each block's gathered parameters and gradients every step. With glibc's
defaults those blocks come from the heap once the threshold has risen to their size, and the sharded
gradients and optimizer state allocated between them fragment it: a rank's resident memory grows step after
step to several times what it holds (`python -m hpc_ddp.bench fsdp`: 100 M parameters, 4 CPU ranks, fsdp 2.6 to
3.0 GB a rank, ddp 4.2 GB; with these settings fsdp 1.1 GB, at the same speed relative to ddp). A fixed
threshold alone returns the memory but makes every gather fault in fresh pages (fsdp 2.5 times slower); huge
pages take most of that cost away. On GPUs it only touches the host side (staging copies, data), where it
returns memory as promptly.

DDP runs with glibc's defaults: its buckets live for the whole run, and what it frees every step are gradients
of the same sizes, which the heap hands back at the next step. Under the fixed threshold every such block of
4 MiB or more is mapped, faulted in and unmapped again at every step: the `mlp` task's 1024 x 1024 weight
gradients made a DDP step 10 % slower than a hand-written loop's (`python -m hpc_ddp.bench overhead`, issue 41).

Who applies it: the local launcher (each rank and the fork server it forks them from) and, in a Slurm job
(`submit`'s and `slurm/ddp.sbatch`'s alike), the batch shell's `begin` step, which reads the run's options
(a `--config` file's `strategy` too) and prints the `export` the shell evaluates before srun. A GLIBC_TUNABLES already in the environment is left as it is (an empty one: glibc's
defaults); ranks started otherwise (torchrun, a plain `python -m hpc_ddp.train`) get what their environment
says. Older glibc ignores tunables it does not know; without THP (`never`) the madvise does nothing.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

VAR = "GLIBC_TUNABLES"
SETTINGS = "glibc.malloc.mmap_threshold=4194304:glibc.malloc.hugetlb=1"
# The strategies whose ranks start with SETTINGS (see above); any other keeps glibc's defaults.
RETURN_FREED = frozenset({"fsdp"})


def for_ranks(environ: Mapping[str, str], strategy: str) -> dict[str, str]:
    """What to add to the environment of a rank of `strategy` (pure): the kit's settings where the strategy
    needs them, unless GLIBC_TUNABLES is set there."""
    return {VAR: SETTINGS} if strategy in RETURN_FREED and VAR not in environ else {}


def exports(environ: Mapping[str, str], strategy: str) -> str:
    """`for_ranks` as shell lines for the batch shell to evaluate before srun ('' when nothing is added)."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in for_ranks(environ, strategy).items())
