"""A job as submitit submits it: its parameters built once (`build`), then shown (`Submission.script`, what
`--print-sbatch` prints) or submitted (`Submission.submit`: submitit runs sbatch). The only code of the kit that
hands a job to sbatch.

The parameters: the request's (hpc_ddp.scheduler.slurm.request.SlurmRequest), the container's and the user's
srun options, a comment that says which python runs (hpc_ddp.scheduler.slurm.runtime), and for a training job
the batch shell's steps around srun (`with_batch_steps`: attempts, retries). sbatch runs with the submitting
environment minus an enclosing job's variables, which it would export into the job (`submission_environ`).
"""

from __future__ import annotations

import io
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.scheduler.slurm import runtime
from hpc_ddp.scheduler.slurm.request import SlurmRequest, sbatch_error, submit_environ, with_batch_steps


@dataclass(frozen=True)
class Submission:
    """What submitit needs, built once by `build`: the same parameters make the script `--print-sbatch`
    shows and the job sbatch gets."""

    files: Path  # submitit's folder: <run folder>/submitit
    parameters: dict[str, Any] = field(hash=False)  # SlurmExecutor.update_parameters' keyword arguments
    python: str  # how each task starts python (submitit's `python` parameter)
    max_requeue: int = 0  # submitit's max_num_timeout: how often it requeues a job on its own

    def script(self) -> str:
        """The sbatch script submitit writes for this job, ended with a newline."""
        from submitit.slurm.slurm import _make_sbatch_string

        command = f"{self.python} -u -m submitit.core._submit {shlex.quote(str(self.files))}"
        return _ended(_make_sbatch_string(command=command, folder=self.files, **self.parameters))

    def array_script(self, count: int, parallel: int, after: str | None = None) -> str:
        """The sbatch script of a job array of `count` elements, `parallel` at a time (`--array=0-N%P`), once the
        job `after` has ended if given (`--dependency=afterany:JOB`)."""
        from submitit.slurm.slurm import _make_sbatch_string

        command = f"{self.python} -u -m submitit.core._submit {shlex.quote(str(self.files))}"
        params = {**self._after(after), "map_count": count, "array_parallelism": parallel}
        return _ended(_make_sbatch_string(command=command, folder=self.files, **params))

    def _after(self, job: str | None) -> dict[str, Any]:
        """The parameters, with `--dependency=afterany:JOB` among the additional ones where `job` is given."""
        if job is None:
            return dict(self.parameters)
        extra = {**self.parameters.get("additional_parameters", {}), "dependency": f"afterany:{job}"}
        return {**self.parameters, "additional_parameters": extra}

    def submit_array(self, calls: list[Any], parallel: int, after: str | None = None) -> list[str]:
        """sbatch one job array whose element i runs `calls[i]` on every task, `parallel` at a time, once the
        job `after` has ended if given: each element's id, ARRAY_INDEX (submitit submits a single call as a
        plain job: its id alone). sbatch's refusal is a UsageError, as for `submit`."""
        import submitit
        from submitit.core.utils import FailedJobError

        class Executor(submitit.SlurmExecutor):  # type: ignore[misc]
            def _make_submission_file_text(self, command: str, uid: str) -> str:
                return _ended(super()._make_submission_file_text(command, uid))

        executor = Executor(folder=self.files, max_num_timeout=self.max_requeue, python=self.python)
        executor.update_parameters(**self._after(after), array_parallelism=parallel)
        with submission_environ(), redirect_stderr(io.StringIO()):
            try:
                with executor.batch():
                    jobs = [executor.submit(call) for call in calls]
            except FailedJobError as e:
                raise UsageError(sbatch_error(str(e))) from None
        return [str(job.job_id) for job in jobs]

    def submit(self, call: Any) -> str:
        """sbatch the job that runs `call` (pickled by submitit into its folder) on every task: its id. sbatch's
        refusal is a UsageError, in one line with the flag to fix."""
        import submitit
        from submitit.core.utils import FailedJobError

        class Executor(submitit.SlurmExecutor):  # type: ignore[misc]
            def _make_submission_file_text(self, command: str, uid: str) -> str:
                return _ended(super()._make_submission_file_text(command, uid))  # as --print-sbatch shows it

        executor = Executor(folder=self.files, max_num_timeout=self.max_requeue, python=self.python)
        executor.update_parameters(**self.parameters)
        # submitit prints sbatch's stderr when sbatch fails; it is in the exception too, and becomes one line.
        with submission_environ(), redirect_stderr(io.StringIO()):
            try:
                job = executor.submit(call)
            except FailedJobError as e:
                raise UsageError(sbatch_error(str(e))) from None
        return str(job.job_id)


def check_submit_host() -> None:
    """Refuse, in one line, to go on where sbatch is missing: no job can be submitted from here."""
    if shutil.which("sbatch") is None:
        raise UsageError(
            "sbatch not found on PATH: this machine is not a Slurm submit host. Fix: run on a login "
            "node (or load the Slurm module), use --print-sbatch to see the script, or --local"
        )


def build(
    request: SlurmRequest,
    folder: Path,
    files: Path,
    steps: tuple[str, ...] | None = None,
    max_requeue: int = 0,
    select: str = "",
) -> Submission:
    """The job for `request`, its run folder `folder` (mounted or bound in a container) and submitit's `files`.
    `steps`: the training options the batch shell's steps get (a training job); None: no steps (a check).
    `select`: a job array's line that sets each element's options instead (request.with_batch_steps)."""
    rt = request.runtime
    params = request.executor_parameters()
    params["srun_args"] = [*params["srun_args"], *runtime.srun_options(rt, str(folder))]
    params["setup"] = [runtime.explain(rt, sys.executable), *params.get("setup", [])]
    if steps is not None:
        python = shlex.quote(runtime.batch_interpreter(rt, sys.executable))
        params = with_batch_steps(params, python, steps, str(files), select)
    return Submission(files, params, task_python(request, folder), max_requeue)


def task_python(request: SlurmRequest, folder: Path) -> str:
    """How each task starts python (submitit's `python` parameter): the interpreter `runtime` chooses, in the
    Apptainer image if any, through hpc_ddp.launch.slurm.start, which blocks the preemption signals from its
    first instruction until the task's handler takes them (a USR2 while a task starts killed it)."""
    return runtime.task_command(request.runtime, sys.executable, str(folder))


def _ended(text: str) -> str:
    """The script with its last line ended: submitit's has none, which `--print-sbatch > job.sh` and `cat`
    show as a prompt glued to the last line."""
    return text if text.endswith("\n") else text + "\n"


@contextmanager
def submission_environ() -> Iterator[None]:
    """os.environ without an enclosing job's variables, while sbatch runs (sbatch exports it into the job). The
    tasks' allocator settings are the batch shell's `begin` step's (hpc_ddp.cluster.allocator)."""
    saved = dict(os.environ)
    clean = submit_environ(saved)
    for key in set(saved) - set(clean):
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
