"""Issue 36, the meta path: a model given as a factory gets the kit's initial weights (hpc_ddp.run.loop.materialize),
the same whether it was built for real or on the meta device, sharded or not; what nothing would initialize is
refused at start in one line naming it; a plain module keeps working as it is.

In-process: pure functions, and FSDP on a real one-rank gloo group (the multi-rank runs: test_run_fsdp.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster import group
from hpc_ddp.errors import UsageError
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop import materialize

CPU = torch.device("cpu")


class Net(nn.Module):
    """Blocks in a ModuleList (what fsdp shards), a norm with buffers, a head tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


class Scaled(Net):
    """A module holding a parameter itself, with no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def on_meta_then_filled(factory: Any, seed: int, init_weights: Any = None) -> nn.Module:
    """The fsdp path without the sharding: built on the meta device, allocated, filled."""
    model = materialize.on_meta(factory)
    reference = materialize.meta_reference(model)
    model.to_empty(device=CPU)
    materialize.fill(model, reference, seed, init_weights)
    return model


def test_built_for_real_or_on_the_meta_device_the_same_weights_for_a_seed_and_ties_kept() -> None:
    before = torch.get_rng_state()
    eager = materialize.eager(Net, 5, None)
    assert torch.equal(torch.get_rng_state(), before)  # the constructors' draws leave the run's stream alone
    meta = on_meta_then_filled(Net, 5)
    assert same(state(eager), state(meta))
    assert meta.head.weight is meta.embed.weight and eager.head.weight is eager.embed.weight
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in Net().named_parameters()]
    assert torch.equal(meta.norm.running_var, torch.ones(6)) and int(meta.norm.num_batches_tracked) == 0
    assert not same(state(eager), state(materialize.eager(Net, 6, None)))  # another seed, other weights
    # Keyed by module name: a module's values do not depend on what comes before it.
    deeper = materialize.eager(lambda: Net(depth=4), 5, None)
    assert torch.equal(deeper.layers[2][0].weight, eager.layers[2][0].weight)
    assert not torch.equal(eager.layers[1][0].weight, eager.layers[2][0].weight)


def test_init_weights_runs_after_reset_parameters_on_each_module() -> None:
    seen: list[str] = []

    def init_weights(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, Scaled):
            module.scale.fill_(0.5)

    model = materialize.eager(Scaled, 0, init_weights)
    assert all(bool((layer[0].bias == 0).all()) for layer in model.layers)
    assert float(model.layers[0][0].weight.detach().abs().sum()) > 0  # reset_parameters' values kept
    assert bool((model.scale == 0.5).all())
    # Each module holding tensors itself, once (the head's only tensor is the embedding's: not again).
    assert sorted(seen) == sorted(["Scaled", "Embedding", "Linear", "Linear", "Linear", "BatchNorm1d"])
    assert same(state(model), state(on_meta_then_filled(Scaled, 0, init_weights)))


def test_what_nothing_initializes_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(UsageError) as caught:
        materialize.eager(Scaled, 0, None)
    message = str(caught.value)
    assert "\n" not in message
    assert "the model itself (Scaled) holds scale but has no reset_parameters()" in message
    assert "init_weights=fn" in message

    def forgets(module: nn.Module) -> None:  # sets nothing: the root's `scale` stays unset
        pass

    with pytest.raises(
        UsageError, match=r"the initial values of scale in the model itself \(Scaled\) were not set"
    ):
        on_meta_then_filled(Scaled, 0, forgets)

    class Counter(nn.Module):  # an integer buffer, no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    model = nn.Sequential(nn.Linear(2, 2), Counter())
    with pytest.raises(UsageError, match=r"its module 1 \(Counter\) holds seen but has no reset_parameters"):
        materialize.check(materialize.on_meta(lambda: copy.deepcopy(model)), None)
    with pytest.raises(
        UsageError, match=r"the initial values of 1.seen in its module 1 \(Counter\) were not set"
    ):
        on_meta_then_filled(lambda: copy.deepcopy(model), 0, forgets)


def test_a_factory_that_returns_no_module_and_init_weights_with_an_instance_are_refused() -> None:
    with pytest.raises(UsageError, match="Task.model is a function that returned int: expected an nn.Module"):
        materialize.eager(lambda: 3, 0, None)  # type: ignore[arg-type,return-value]
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    task = tasks.Task(model=nn.Linear(2, 1), dataset=data, loss_fn=nn.functional.mse_loss, init_weights=print)
    with pytest.raises(UsageError, match="Task.init_weights is given with a model instance"):
        tasks.check(task, "--task t")
    tasks.check(tasks.Task(model=Net, dataset=data, loss_fn=nn.functional.mse_loss, init_weights=print), "t")


def test_fsdp_builds_a_factory_on_the_meta_device_and_a_plain_module_as_before() -> None:
    """A real one-rank group: the factory's model is sharded from the meta device, filled, trainable; its full
    state is the eager build's. A module instance is sharded as it is, its weights untouched."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from hpc_ddp.run.strategy.fsdp import FULL, FSDPStrategy

    cfg = TrainConfig(strategy="fsdp", seed=3)
    env = dist_env.detect({})
    plain = Net()
    plain_weights = state(plain)
    with group.process_group(env, CPU):
        built = FSDPStrategy(cfg, env, CPU)
        wrapped, optimizer = built.setup(Net, lambda params: torch.optim.SGD(params, lr=0.1))
        assert not any(p.is_meta for p in built.model.parameters())
        full = get_model_state_dict(built.model, options=FULL)
        assert same({k: v.clone() for k, v in full.items()}, state(materialize.eager(Net, 3, None)))
        loss = wrapped(torch.tensor([1, 2, 3])).sum()
        loss.backward()
        optimizer.step()
        kept = FSDPStrategy(cfg, env, CPU)
        kept.setup(plain, lambda params: torch.optim.SGD(params, lr=0.1))
        assert same(dict(get_model_state_dict(kept.model, options=FULL)), plain_weights)
        built.close()
        kept.close()
