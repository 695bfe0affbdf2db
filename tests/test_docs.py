"""The docs speak to users first: README opens with the user guide, and no `--help` names an internal module.

A user reads the README from the top and stops after a few screens: those screens must be how to start, how to
bring a model, how to run on a cluster, what happens when things fail, how to see a run, and the options by
topic. The reference (run-folder rules, hang doctor internals, records, exit codes, architecture) follows a
table of contents.
`--help` is for options and behaviour; names like `hpc_ddp.run.session` or `resume.plan` mean nothing to a user.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT

# The user guide, in this order, before anything else (matched at the start of each `## ` header).
GUIDE = (
    "Quick start",
    "Your own model",
    "On a Slurm cluster",
    "When things fail",
    "See a run",
    "Options by topic",
)
ENTRY_POINTS = (
    "hpc_ddp",
    "hpc_ddp.train",
    "hpc_ddp.submit",
    "hpc_ddp.doctor",
    "hpc_ddp.bench",
    "hpc_ddp.report",
)
PUBLIC = {"hpc_ddp.Task", "hpc_ddp.TrainConfig", "hpc_ddp.detect", "hpc_ddp.DistEnv", *ENTRY_POINTS}
INTERNAL = (
    re.compile(r"\bhpc_ddp(?:\.[A-Za-z_]+)+"),  # a dotted module path (public names allowed below)
    re.compile(r"\bhpc_ddp/[\w/]+\.py\b"),  # a source file
    re.compile(r"\b(?:resume|folder|session|trainer|metrics|beacon|watchdog)\.[a-z_]+\b"),  # module.function
    re.compile(r"\b(?:Trainer|NullBeacon|Watchdog|Recorder|Checkpointer)\b"),  # internal classes
)

FILES = re.compile(r"\.(?:jsonl?|html|pth|lock|png|txt|sh)$")  # a file a user reads: metrics.jsonl, run.lock


def sections(text: str) -> list[str]:
    return [line[3:].strip() for line in text.splitlines() if line.startswith("## ")]


def internal_names(text: str) -> list[str]:
    found = []
    for pattern in INTERNAL:
        for match in pattern.finditer(text):
            name = match.group(0).rstrip(".")
            if name not in PUBLIC and not FILES.search(name):
                found.append(name)
    return found


def test_internal_names_are_found_in_a_help_text() -> None:
    text = "(hpc_ddp.run.session) `resume.plan` looks; hpc_ddp/bench/hand.py; Trainer.run(); hpc_ddp.Task and metrics.jsonl are fine"
    assert internal_names(text) == ["hpc_ddp.run.session", "hpc_ddp/bench/hand.py", "resume.plan", "Trainer"]


def test_the_readme_opens_with_the_user_guide_then_a_table_of_contents() -> None:
    heads = sections((ROOT / "README.md").read_text())
    assert len(heads) > len(GUIDE), heads
    for want, head in zip(GUIDE, heads, strict=False):
        assert head.startswith(want), f"README's sections start {heads[: len(GUIDE)]}, expected {list(GUIDE)}"
    assert heads[len(GUIDE)].startswith("Reference"), f"after the guide: {heads[len(GUIDE)]!r}"
    toc = (ROOT / "README.md").read_text().split("## Reference", 1)[1].split("\n## ", 1)[0]
    for head in heads[len(GUIDE) + 1 :]:  # every reference section is listed in the table of contents
        assert head in toc, f"{head!r} is not in the Reference table of contents"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_no_help_names_an_internal_module(entry: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", entry, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert internal_names(out.stdout) == [], f"`python -m {entry} --help` names internal modules"
