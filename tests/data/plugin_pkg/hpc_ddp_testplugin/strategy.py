"""--strategy test-ddp: the kit's DDP strategy, as a user would derive from it, logging its calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.plugins import DDPStrategy
from hpc_ddp_testplugin import log


class TestDDP(DDPStrategy):
    def setup(self, model: Any, optimizer: Any) -> Any:
        log("strategy", "setup")
        return super().setup(model, optimizer)

    def model_state(self) -> dict[str, Any]:
        log("strategy", "model_state")
        return super().model_state()

    def load_model_state(self, state: dict[str, Any], path: Path) -> None:
        log("strategy", "load_model_state")
        super().load_model_state(state, path)
