"""torch's settings that only fail at scale (hpc_ddp.cluster.settings): each said in one line with its fix, at
start, whatever the job's size; the rank 0 of a real group prints them."""

from __future__ import annotations

import pytest

from hpc_ddp.cluster import settings


@pytest.mark.parametrize(
    "environ, world, backend, timeout, said",
    [
        ({"TORCH_DIST_INIT_BARRIER": "1"}, 2, "gloo", 600.0, "TORCH_DIST_INIT_BARRIER=1: "),
        ({"USE_LIBUV": "0"}, 2, "gloo", 600.0, "USE_LIBUV=0: "),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, 16, "nccl", 600.0, "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: "),
        ({"NCCL_ASYNC_ERROR_HANDLING": "0"}, 16, "nccl", 600.0, "NCCL_ASYNC_ERROR_HANDLING=0: "),
        ({}, 8192, "nccl", 120.0, "--timeout-s 120 at 8192 ranks: "),
    ],
)
def test_a_setting_that_fails_at_scale_is_one_line_with_its_fix(
    environ: dict[str, str], world: int, backend: str, timeout: float, said: str
) -> None:
    found = settings.warnings(environ, world, backend, timeout)
    assert len(found) == 1 and found[0].startswith(said) and "Fix: " in found[0], found
    assert "\n" not in found[0]


@pytest.mark.parametrize(
    "environ, world, backend, timeout",
    [
        ({}, 8192, "nccl", 600.0),  # the kit's defaults
        (
            {"TORCH_DIST_INIT_BARRIER": "0", "USE_LIBUV": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
            8192,
            "nccl",
            300.0,
        ),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, 4, "gloo", 600.0),  # NCCL's variable means nothing to gloo
        ({}, 1023, "gloo", 60.0),  # a short timeout below LARGE_RANKS: the start is quick there
    ],
)
def test_right_settings_say_nothing(
    environ: dict[str, str], world: int, backend: str, timeout: float
) -> None:
    assert settings.warnings(environ, world, backend, timeout) == []


def test_rank_0_of_a_real_group_prints_the_warning(monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    import torch

    from hpc_ddp.cluster.env import DistEnv
    from hpc_ddp.cluster.group import process_group

    monkeypatch.setenv("USE_LIBUV", "0")
    env = DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 0, None, "single")
    with process_group(env, torch.device("cpu"), "gloo", 60.0):
        pass
    assert "hpc_ddp: warning: USE_LIBUV=0: " in capfd.readouterr().err
