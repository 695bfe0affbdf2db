"""`python -m hpc_ddp.doctor`: one task of the pre-flight check (see hpc_ddp.doctor.checkup);
`python -m hpc_ddp.doctor resume --task ...`: the resume check, run once on this machine (hpc_ddp.doctor.resume).
"""

import sys

from hpc_ddp.doctor.checkup import PROG, main
from hpc_ddp.errors import run_main, run_task

if __name__ == "__main__":
    if sys.argv[1:2] == ["resume"]:
        from hpc_ddp.run import startup

        # The check reads checkpoints with torch (its modules import it): the same paused, frozen import as a
        # rank's, about 0.6 CPU-s less for each check on the 2-core test machine. No torch._dynamo: it trains nothing.
        startup.import_frozen("torch")
        from hpc_ddp.doctor import resume

        run_main(resume.PROG, lambda: resume.main(sys.argv[2:]))
    run_task(PROG, main)
