"""env/gpu-check.sh's meta-construction step: the initial weights a run of `fsdp_tasks:no_dropout` wrote
($INITIAL_OUT: every parameter whole, gathered from the ranks' shards as the optimizer was built) against the
same factory built here, in one process on CPU, for real (no meta device). Bitwise equal: one line, exit 0;
otherwise the first parameter that differs, exit 1.

    python tests/meta_check.py <initial.pt> <seed>
"""

from __future__ import annotations

import sys

import torch
from fsdp_tasks import without_dropout

from hpc_ddp.run.loop import materialize


def main(path: str, seed: int) -> int:
    found = torch.load(path, weights_only=True)
    expected = list(materialize.eager(without_dropout, seed, None).named_parameters())
    if len(found) != len(expected):
        print(f"meta construction: {len(found)} parameters written, {len(expected)} expected")
        return 1
    for tensor, (name, param) in zip(found, expected, strict=True):
        if tensor.shape != param.shape or not torch.equal(tensor.cpu(), param.detach()):
            worst = (tensor.cpu().double() - param.detach().double()).abs().max().item()
            print(f"meta construction: {name} differs from the CPU build (largest difference {worst:.3g})")
            return 1
    print(f"meta construction: {len(found)} parameters bitwise equal to the CPU build of seed {seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
