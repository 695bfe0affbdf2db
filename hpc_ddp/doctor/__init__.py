"""`python -m hpc_ddp.doctor`: the pre-flight check of a distributed launch, run on every rank.

`facts` is what one rank finds about itself, `rules` judges every rank's facts (pure), `collective` is the
all-reduce benchmark, `report` prints the verdict, and `checkup` runs it all: derive, probe, meet the other
ranks through a store, judge, print. Importing this package is cheap: `main` loads the rest when called.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the doctor with `argv` (a task's entry point: `submit --doctor` runs `hpc_ddp.doctor.main`)."""
    from hpc_ddp.doctor.checkup import main as checkup_main

    return checkup_main(argv)
