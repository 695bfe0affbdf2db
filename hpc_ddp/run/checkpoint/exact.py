"""What keeps a run from resuming bit for bit, known at start (pure): said in one line, and in `run.json`.

The kit's promise is that a stop anywhere resumes exactly: every later step gets the inputs it would have got
(hpc_ddp.run.data.seeding, rng, parts). Where a set-up cannot keep it, the run says so before training, once, on
the console (`not bitwise resumable: ...`) and in `run.json` (`"exact": false`, `"not_exact": [the reasons]`),
instead of diverging silently after the first resume. The reasons, each with its fix:

    a stream without state_dict()/load_state_dict()     its epoch restarts on a mid-epoch resume
    a stateful stream read by workers, no torchdata     the same (torchdata's StatefulDataLoader keeps them)
    CUDA without --deterministic                        non-deterministic kernels (atomics, cuBLAS workspaces)
    a run resized on resume (--allow-resize)            another split of the data and of the global batch
"""

from __future__ import annotations

RESIZED = "resumed on another number of ranks (--allow-resize): the data and the batch split differ"


def limits(
    *, stream: bool, stream_state: bool, workers: int, stateful_loader: bool, cuda: bool, deterministic: bool
) -> list[str]:
    """Why a resume of this run may differ from an uninterrupted run; [] when it cannot."""
    why = []
    if stream and not stream_state:
        why.append(
            "the IterableDataset has no state_dict()/load_state_dict(), so a mid-epoch resume restarts its epoch "
            "(give it both)"
        )
    elif stream and workers and not stateful_loader:
        why.append(
            "the IterableDataset is read by DataLoader workers and torchdata is not installed, so a mid-epoch "
            "resume restarts its epoch (pip install 'hpc-ddp[data]', or --num-workers 0)"
        )
    if cuda and not deterministic:
        why.append("CUDA kernels are not deterministic without --deterministic")
    return why  # a resize (RESIZED) is known later, to the session
