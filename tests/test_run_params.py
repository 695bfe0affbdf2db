"""The optimizer factory's parameters (hpc_ddp.run.loop.params, issue 37 item 1), in-process on a real one-rank gloo
group: named as the bare model names them under ddp and fsdp alike, the ones the wrapped model trains (fsdp's
shards); an unnamed factory works as before; an optimizer over parameters collected before wrapping is refused.
Weight decay really applied by group, in 2-rank runs: tests/test_run_fsdp.py (the ddp/fsdp comparison)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.errors import UsageError
from hpc_ddp.run import strategy as strategies
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.params import Parameters


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[1](self.layers[0](x)))


NAMES = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "head.weight", "head.bias"]


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_the_factory_gets_the_trained_parameters_named_as_the_bare_model(name: str, tmp_path: Path) -> None:
    env = dist_env.detect({})
    cfg = TrainConfig(strategy=name, folder=str(tmp_path))
    got: list[Parameters] = []

    def factory(params: Parameters) -> torch.optim.Optimizer:
        got.append(params)
        named = params.named()
        decay = [p for n, p in named if n.endswith("weight") and not n.startswith("layers.1")]
        rest = [p for n, p in named if not (n.endswith("weight") and not n.startswith("layers.1"))]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])

    with process_group(env, torch.device("cpu")):
        strategy = strategies.create(name, cfg, env, torch.device("cpu"))
        try:
            model = Net()
            optimizer = strategy.setup(model, factory)[1]  # the wrapper: only the strategy holds it
            params = got[0]
            assert [n for n, _ in params.named()] == NAMES  # no "module." prefix under ddp
            assert [id(p) for p in params] == [id(p) for p in model.parameters()]  # what the loop steps
            kinds = {type(p).__name__ for p in params}
            assert kinds == ({"DTensor"} if name == "fsdp" else {"Parameter"}), kinds
            assert [len(g["params"]) for g in optimizer.param_groups] == [2, 4]
            # An unnamed factory: a list of parameters, as before.
            assert isinstance(params, list) and len(params) == 6
        finally:
            strategy.close()


def test_an_optimizer_over_parameters_collected_before_wrapping_is_refused_under_fsdp(tmp_path: Path) -> None:
    env = dist_env.detect({})
    cfg = TrainConfig(strategy="fsdp", folder=str(tmp_path))
    model = Net()
    early = list(model.parameters())  # fully_shard replaces these by their shards
    with process_group(env, torch.device("cpu")):
        strategy = strategies.create("fsdp", cfg, env, torch.device("cpu"))
        try:
            with pytest.raises(UsageError) as refused:
                strategy.setup(model, lambda params: torch.optim.SGD(early, lr=0.1))
        finally:
            strategy.close()
    assert str(refused.value) == (
        "Task.optimizer built an optimizer over 6 tensor(s) that are not the parameters the model trains under "
        "--strategy fsdp (collected before the kit wrapped the model? fsdp replaces them by their shards). Fix: "
        "build the optimizer from the `params` the factory gets: params.named() gives (name, parameter) pairs "
        "for groups by name"
    )


def test_asking_fsdp_for_the_optimizer_state_before_the_first_step_changes_no_step(tmp_path: Path) -> None:
    """The checkpointer asks for the optimizer's state at start (check_savable). torch's answer for an optimizer
    that never stepped steps it once with zero gradients and lr 0: AdamW's `step` became 1 (the first real step
    then corrected its bias as the second's) and SGD's momentum took weight decay x the weights. Found by the
    weight-decay groups of issue 37: fsdp's first AdamW step must be ddp's, bit for bit."""
    first: dict[str, torch.Tensor] = {}
    for name in ("ddp", "fsdp"):
        env = dist_env.detect({})
        cfg = TrainConfig(strategy=name, folder=str(tmp_path), checkpoint_format="full")
        with process_group(env, torch.device("cpu")):
            strategy = strategies.create(name, cfg, env, torch.device("cpu"))
            try:
                torch.manual_seed(0)
                optimizer = strategy.setup(Net(), lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1))[1]
                strategy.optimizer_state()
                assert not optimizer.state  # the first real step starts from nothing, as under ddp
                assert strategy.wrapped is not None
                strategy.wrapped(torch.ones(2, 4)).sum().backward()
                optimizer.step()
                weight = dict(strategy.model.named_parameters())["head.weight"].detach()
                first[name] = weight.full_tensor() if hasattr(weight, "full_tensor") else weight.clone()
            finally:
                strategy.close()
    assert torch.equal(first["ddp"], first["fsdp"]), first
