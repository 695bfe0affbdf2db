"""The progress line and its followers, without a run: the text of a step record, the ETA, the follower of a
growing metrics.jsonl, the live line on a terminal and in a file, `submit --wait` on a fixture folder, the
local launcher's console holding rank 0's live line, and --tensorboard's check for its package."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from fake_slurm import FakeClock, FakeSlurm

from hpc_ddp.errors import UsageError
from hpc_ddp.launch import local
from hpc_ddp.launch.slurm import follow, submitter
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.records import progress, tblog
from hpc_ddp.run.records.progress import LIVE
from hpc_ddp.scheduler.slurm.client import SlurmClient


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def step(**fields: object) -> dict[str, object]:
    record: dict[str, object] = {
        "event": "step",
        "epoch": 1,
        "step": 120,
        "loss": 0.12345,
        "samples_per_s": 1530.4,
        "total_steps": 400,
        "eta_s": 185.2,
    }
    record.update(fields)
    return record


@pytest.mark.parametrize(
    "record, text",
    [
        (step(), "epoch 1 step 120/400 loss 0.1235 | 1,530 samples/s | ETA 3m05s"),
        (
            step(eta_s=None),
            "epoch 1 step 120/400 loss 0.1235 | 1,530 samples/s | ETA ?",
        ),  # the first step: no time yet
        (step(step=400, eta_s=0.0), "epoch 1 step 400/400 loss 0.1235 | 1,530 samples/s | done"),
        (step(loss=None), "epoch 1 step 120/400 loss nan | 1,530 samples/s | ETA 3m05s"),  # a non-finite loss
        (step(total_steps=0), "epoch 1 step 120 loss 0.1235 | 1,530 samples/s"),  # total unknown: no ETA
        (
            step(step=1, samples_per_s=0.0, eta_s=None),
            "epoch 1 step 1/400 loss 0.1235 | ETA ?",
        ),  # no rate yet
        (
            {"event": "step", "epoch": 0, "step": 3, "loss": 2.0},
            "epoch 0 step 3 loss 2.0000",
        ),  # an older record
    ],
)
def test_the_progress_line_of_a_step_record(record: dict[str, object], text: str) -> None:
    assert progress.line(record) == text


def test_every_value_on_the_progress_line_has_one_format() -> None:
    """Issue 42: `accuracy 1`, `0.375` and `0.9688` on one line (%.4g); now every value as the loss is."""
    record = step(
        loss=0.5, metrics={"accuracy": 1.0, "top5": 0.375, "f1": 0.96875, "lr": 2.5e-05, "ppl": 1.2345e7}
    )
    assert progress.line(record) == (
        "epoch 1 step 120/400 loss 0.5000 accuracy 1.0000 top5 0.3750 f1 0.9688 lr 2.500e-05 ppl 1.234e+07 | "
        "1,530 samples/s | ETA 3m05s"
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0, "0.0000"), (1.0, "1.0000"), (-0.25, "-0.2500"), (0.001, "0.0010"), (0.0009, "9.000e-04")]
    + [(999999.0, "999999.0000"), (1e6, "1.000e+06"), (None, "nan"), (float("inf"), "inf")],
)
def test_one_rule_for_a_value(value: float | None, text: str) -> None:
    assert progress.value_text(value) == text


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (59.4, "59s"),
        (60, "1m00s"),
        (185, "3m05s"),
        (3599, "59m59s"),
        (7384, "2h03m"),
        (2 * 86400 + 3600, "2d01h"),
        (None, "?"),
        (float("inf"), "?"),
        (float("nan"), "?"),
        (-1, "?"),
    ],
)
def test_durations(seconds: float | None, text: str) -> None:
    assert progress.duration(seconds) == text


@pytest.mark.parametrize(
    "step, total, recent, eta",
    [
        (10, 100, [0.5, 1.5], 90.0),  # 90 steps left at the mean of the recent ones (1 s)
        (100, 100, [1.0], 0.0),
        (120, 100, [1.0], 0.0),  # past the total (a raised --max-steps afterwards): never negative
        (10, 100, [], None),  # only the first step so far: it is left out, so no estimate
        (10, 0, [1.0], None),  # total unknown
    ],
)
def test_eta_from_the_recent_step_times(
    step: int, total: int, recent: list[float], eta: float | None
) -> None:
    assert progress.eta_s(step, total, recent) == eta


@pytest.mark.parametrize(
    "epochs, per_epoch, max_steps, total", [(10, 8, 0, 80), (10, 8, 20, 20), (2, 8, 100, 16)]
)
def test_total_steps(epochs: int, per_epoch: int, max_steps: int, total: int) -> None:
    assert progress.total_steps(epochs, per_epoch, max_steps) == total


def test_the_follower_returns_whole_new_records_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = progress.Follower(path)
    assert follower.poll() == []  # not there yet
    with open(path, "wb") as f:
        f.write(b'{"event": "step", "step": 1}\n{"event": "step", "st')  # a line still being written
        f.flush()
        assert follower.poll() == [{"event": "step", "step": 1}]
        f.write(b'ep": 2}\n{"event": "ste\n')  # ... finished, then one that a crash cut
        f.write(b'{"event": "end", "step": 2}\n')
        f.flush()
        assert follower.poll() == [{"event": "step", "step": 2}, {"event": "end", "step": 2}]
        assert follower.poll() == []


def test_the_live_line_is_rewritten_in_place_on_a_terminal_and_plain_in_a_file() -> None:
    terminal, file = FakeTerminal(), io.StringIO()
    for out in (terminal, file):
        stream = progress.LiveStream(out)
        stream.live("step 1")
        stream.live("step 2")
        stream.write("a log line\n")
        stream.live("step 3")
        stream.keep()
    assert terminal.getvalue() == f"{LIVE}step 1{LIVE}step 2{LIVE}a log line\n{LIVE}step 3\n"
    assert file.getvalue() == "step 1\nstep 2\na log line\nstep 3\n"


def write_records(path: Path, *records: dict[str, object]) -> None:
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def follow_on(fake: FakeSlurm, job: str, folder: Path, world: int, out: io.StringIO) -> int:
    """`--wait` on a fake cluster and a fake clock (tests/fake_slurm.py)."""
    clock = FakeClock()
    return follow.follow(
        job,
        CheckpointStore(folder, Local()),
        world,
        0.0,
        SlurmClient(fake),
        out=out,
        clock=follow.Clock(clock.now, clock.sleep),
    )


def test_submit_wait_follows_metrics_jsonl_and_shows_the_progress_line_and_each_start(tmp_path: Path) -> None:
    (tmp_path / "submitit").mkdir()
    metrics = tmp_path / "metrics.jsonl"
    start = {
        "event": "start",
        "job": "77",
        "restart": 0,
        "epoch": 0,
        "step": 0,
        "resumed": False,
        "world_size": 4,
        "startup_s": 9.5,
    }
    fake = FakeSlurm()
    fake.submit("77")
    # The job as Slurm sees it, look by look; the run writes its records meanwhile.
    timeline = [
        (lambda: None, []),
        (lambda: fake.start("77"), [start, step(epoch=0, step=10, eta_s=30.0)]),
        (lambda: None, [step(epoch=0, step=20, eta_s=20.0), {"event": "end", "epoch": 0, "step": 21}]),
        (lambda: fake.requeue("77"), []),
        (
            lambda: fake.start("77"),
            [dict(start, restart=1, step=21, resumed=True, startup_s=12.25), step(step=400, eta_s=0.0)],
        ),
        (lambda: fake.end("77", "COMPLETED"), []),
    ]

    def look(call: tuple[str, ...]) -> None:
        if call[0] == "sacct" and timeline:
            change, records = timeline.pop(0)
            change()
            write_records(metrics, *records)

    fake.on_call = look
    out = io.StringIO()  # a file: its progress lines come from rank 0's log (empty here), not twice
    assert follow_on(fake, "77", tmp_path, 4, out) == 0
    assert out.getvalue().splitlines() == [
        "[run] start 0 of job 77: from the beginning; 4 ranks, 9.5 s from process start to the first step",
        "[run] ranks ended at epoch 0, step 21",
        "[submit] job 77 was requeued; waiting for it to start again",
        "[run] start 1 of job 77: resumed at epoch 0, step 21; 4 ranks, 12.2 s from process start to the first "
        "step",
        f"[submit] job 77 completed; run folder {tmp_path}",
    ]
    # On a terminal the same records also give the live line, rewritten in place.
    fake.submit("77")
    timeline[:] = [
        (lambda: fake.start("77"), [step(epoch=0, step=30, eta_s=10.0)]),
        (lambda: fake.end("77", "COMPLETED"), []),
    ]
    terminal = FakeTerminal()
    assert follow_on(fake, "77", tmp_path, 4, terminal) == 0
    shown = terminal.getvalue()
    assert (
        f"{LIVE}epoch 0 step 10/400 loss 0.1235 | 1,530 samples/s | ETA 30s{LIVE}epoch 0 step 20/400" in shown
    )
    assert shown.endswith(
        f"{LIVE}epoch 0 step 30/400 loss 0.1235 | 1,530 samples/s | ETA 10s\n"
        f"[submit] job 77 completed; run folder {tmp_path}\n"
    )


def test_submit_wait_on_a_terminal_keeps_one_live_line_below_the_log(tmp_path: Path) -> None:
    (tmp_path / "submitit").mkdir()
    log = submitter.log_path(tmp_path, "5")
    fake = FakeSlurm()
    fake.submit("5")
    timeline = [
        ("RUNNING", step(step=1), "Process 0 initialized\n"),
        ("RUNNING", step(step=2), "Epoch 0, Loss: 1\n"),
        ("COMPLETED", step(step=400, eta_s=0), ""),
    ]

    def look(call: tuple[str, ...]) -> None:
        if call[0] == "sacct" and timeline:
            state, record, text = timeline.pop(0)
            fake.start("5") if state == "RUNNING" else fake.end("5", state)
            write_records(tmp_path / "metrics.jsonl", record)
            with open(log, "a") as f:
                f.write(text)

    fake.on_call = look
    out = FakeTerminal()
    assert follow_on(fake, "5", tmp_path, 2, out) == 0
    line = "epoch 1 step {}/400 loss 0.1235 | 1,530 samples/s | "
    assert (
        out.getvalue()
        == (
            f"Process 0 initialized\n{LIVE}{line.format(1)}ETA 3m05s"  # the log's line, then the live line
            f"{LIVE}Epoch 0, Loss: 1\n{LIVE}{line.format(2)}ETA 3m05s"  # erased for the log's next line, drawn again
            f"{LIVE}{line.format(400)}done\n"  # the last state stays
            f"[submit] job 5 completed; run folder {tmp_path}\n"
        )
    )


def test_the_local_console_holds_rank_0s_live_line_at_the_bottom() -> None:
    out = FakeTerminal()
    console = local.Console(out)
    console.live("epoch 0 step 1")
    console.drain()
    console.line("[rank 1] a line")
    console.drain()
    console.live("epoch 0 step 2")
    console.drain()
    console.live("")  # rank 0 ended
    console.drain()
    text = out.getvalue()
    assert text == (f"epoch 0 step 1{LIVE}[rank 1] a line\nepoch 0 step 1{LIVE}epoch 0 step 2{LIVE}")


def test_the_local_console_ignores_live_lines_when_it_is_no_terminal() -> None:
    out = io.StringIO()
    console = local.Console(out)
    console.live("epoch 0 step 1")
    console.line("a line")
    console.drain()
    assert out.getvalue() == "a line\n"


def test_tensorboard_without_its_package_is_a_usage_error_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        tblog, "missing", lambda: "--tensorboard needs the tensorboard package. Fix: " + tblog.INSTALL
    )
    with pytest.raises(UsageError, match=r"pip install 'hpc-ddp\[tensorboard\]'"):
        TrainConfig(tensorboard=True)
    TrainConfig()  # without the flag nothing is checked


def test_the_package_check_names_what_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` then raises
    why = tblog.missing()
    assert why is not None and "--tensorboard needs the tensorboard package" in why and tblog.INSTALL in why


def test_a_start_killed_before_it_recorded_its_event_file_is_read_back_and_a_cut_record_skipped(
    tmp_path: Path,
) -> None:
    pytest.importorskip(
        "tensorboard", reason="needs the tensorboard package (env/setup.sh --test installs it)"
    )
    first = tblog.Board(tmp_path)
    for step in range(1, 8):
        first.scalars(step, {"train/loss": 1.0 / step})
    first.writer.flush()  # killed here: its file is not in logged.json, and a kill cut its last record
    [events] = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events.write_bytes(events.read_bytes()[:-3])
    assert tblog.steps_in(events) == 6
    second = tblog.Board(tmp_path)
    assert second.after == 6
    second.scalars(6, {"train/loss": 9.0})  # trained again after the resume: not written twice
    second.scalars(7, {"train/loss": 0.5, "time/checkpoint_write_s": None})  # None: left out
    second.close()
    second.close()  # idempotent
    record = json.loads((tmp_path / "tb" / "logged.json").read_text())
    assert record["max_step"] == 7 and len(record["files"]) == 2
    third = tblog.Board(tmp_path)  # both files are covered now: nothing is read back
    assert third.after == 7
    third.close()


@pytest.mark.parametrize("how", ["set_aside", "overwrite"])
def test_a_new_line_of_training_moves_the_old_curves_aside(tmp_path: Path, how: str) -> None:
    """TensorBoard never writes a step twice: the curves of a line left behind would hide the new line's steps."""
    from hpc_ddp.run.checkpoint import resume

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    later = ckpts / "ckpt-00000020.pt"
    later.write_bytes(b"x")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "logged.json").write_text('{"max_step": 20, "files": []}\n')
    said: list[str] = []
    chosen = (
        resume.Plan(None, set_aside=(later,)) if how == "set_aside" else resume.Plan(None, overwrite=True)
    )
    resume.apply(chosen, CheckpointStore(tmp_path, Local()), said.append)
    assert not (tmp_path / "tb").exists()
    [moved] = list(
        tmp_path.glob("checkpoints/abandoned-*/tb/logged.json")
        if how == "set_aside"
        else tmp_path.glob("tb-overwritten-*/logged.json")
    )
    assert json.loads(moved.read_text())["max_step"] == 20
    assert any("TensorBoard's curves of the earlier line moved to" in line for line in said), said
