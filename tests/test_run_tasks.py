"""The built-in tasks are what the docs say they are."""

from __future__ import annotations

from conftest import ROOT

from hpc_ddp import bench
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig


def test_mlp_has_the_parameter_count_the_docs_quote() -> None:
    model = tasks.build(TrainConfig(task="mlp")).model
    count = sum(p.numel() for p in model.parameters())
    assert count == 3_428_368
    quoted = f"{count / 1e6:.1f} M parameters"  # "3.4 M parameters"
    for where, text in (
        ("README.md", (ROOT / "README.md").read_text()),
        ("tasks.mlp", tasks.mlp.__doc__ or ""),
        ("hpc_ddp.bench", bench.__doc__ or ""),
    ):
        assert quoted in " ".join(text.split()), where
