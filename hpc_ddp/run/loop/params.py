"""What a task's optimizer factory gets: the parameters the kit trains, with their names (`Task.optimizer`).

    optimizer=lambda params: torch.optim.SGD(params, lr=0.1)          # unnamed: a list of parameters
    optimizer=lambda params: torch.optim.AdamW(groups(params.named()))  # named: (name, parameter) pairs

The factory is called once per rank after the model is wrapped (DDP, or FSDP2's `fully_shard`), with the
parameters the wrapped model trains, so that groups built here step what the loop updates:

- the names are the bare model's, as in `model.named_parameters()` before wrapping and in `model.pth`: no
  `module.` prefix under ddp, and the same under fsdp;
- under fsdp each parameter is a DTensor holding this rank's shard: its name, `shape`, `ndim` and `dtype` are
  the whole parameter's, so groups by name or by shape (no decay for `ndim < 2`) are the same on every rank;
  its values are this rank's shard only, so a rule that reads values would differ between ranks;
- `fully_shard` replaces the model's parameters by their shards, so parameters collected in the task function
  (before wrapping) are not the ones trained: an optimizer over them would step tensors the model no longer
  uses. The kit refuses such an optimizer at start (`check_stepped`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.optim import Optimizer

from hpc_ddp.errors import UsageError


class Parameters(list[nn.Parameter]):
    """The trained parameters, in the model's order: a list (what every torch optimizer takes), and `named()`."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        pairs = list(named)
        super().__init__(p for _, p in pairs)
        self.names = [name for name, _ in pairs]

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs, the names the bare model's (see the module docstring)."""
        return list(zip(self.names, self, strict=True))


def check_stepped(optimizer: Optimizer, trained: Parameters, strategy: str) -> None:
    """UsageError when the optimizer steps a tensor that is not one of the trained parameters."""
    mine = {id(p) for p in trained}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in mine]
    if not foreign:
        return
    raise UsageError(
        f"Task.optimizer built an optimizer over {len(foreign)} tensor(s) that are not the parameters the model "
        f"trains under --strategy {strategy} (collected before the kit wrapped the model? fsdp replaces them by "
        "their shards). Fix: build the optimizer from the `params` the factory gets: params.named() gives "
        "(name, parameter) pairs for groups by name"
    )
