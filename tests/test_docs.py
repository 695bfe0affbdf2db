"""The docs speak to users first: README is the user guide, docs/ the reference, and no `--help` names an
internal module.

A user reads the README from the top and stops after a few screens: those screens must be how to start, how to
bring a model, how to run on a cluster, what happens when things fail, how to see a run, the options by topic
and the resume check; README stays short enough to be read (at most 600 lines). The reference (run-folder rules,
hang doctor internals, records, exit codes, architecture) is in docs/*.md, every page linked from README's
"Reference" table of contents, and every relative link of README and docs/ leads somewhere: a file that exists,
and a heading of it for a `#anchor`. No line of prose is wider than 200 characters.
`--help` is for options and behaviour; names like `hpc_ddp.run.session` or `resume.plan` mean nothing to a user.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
    "Does a stop resume your task exactly",
)
README_LINES = 600  # README is the guide; the reference is in docs/
LINE_CHARS = 200  # no line of README or docs/ wider, outside fenced code (console output is shown as printed)
ENTRY_POINTS = (
    "hpc_ddp",
    "hpc_ddp.train",
    "hpc_ddp.submit",
    "hpc_ddp.doctor",
    "hpc_ddp.bench",
    "hpc_ddp.report",
)
PUBLIC = {
    "hpc_ddp.Task",
    "hpc_ddp.Callback",
    "hpc_ddp.plugins",
    "hpc_ddp.TrainConfig",
    "hpc_ddp.detect",
    "hpc_ddp.DistEnv",
    *ENTRY_POINTS,
}
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
    for head in heads[len(GUIDE) + 1 :]:  # every reference section left in README is in the table of contents
        assert head in toc, f"{head!r} is not in the Reference table of contents"
    linked = {target.split("#", 1)[0] for _, target in links(toc)}
    pages = sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))
    assert pages, "no docs/*.md pages"
    for page in pages:  # every reference page is reachable from README
        assert page in linked, f"{page} is not in README's Reference table of contents"


# Markdown's fenced code, inline code, links and headings, as GitHub renders them.
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[([^\[\]]*)\]\(([^()\s]+)\)")  # [text](target), an image's ![text](target) too


def prose(text: str) -> str:
    """The text without fenced code (its lines kept, empty, so that line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def links(text: str) -> list[tuple[str, str]]:
    """Every `[text](target)` outside code, a link text over several lines included."""
    return [(m.group(1), m.group(2)) for m in LINK.finditer(INLINE_CODE.sub("", prose(text)))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped but '-' and '_', spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text).splitlines():
        heading = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if heading:
            name = slug(heading.group(1))
            found.add(name if name not in seen else f"{name}-{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
    return found


def dead_links(path: Path) -> list[str]:
    """The relative links of a markdown file that lead nowhere: a missing file, or an anchor no heading has."""
    dead = []
    for text, target in links(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            dead.append(f"{path.name}: [{text}]({target}): no file {file}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where.read_text()):
            dead.append(f"{path.name}: [{text}]({target}): no heading #{anchor} in {where.name}")
    return dead


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_link_checker_finds_dead_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Sharded training (fsdp): `--strategy fsdp`\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/page.md) [ok over\ntwo lines](docs/page.md#sharded-training-fsdp---strategy-fsdp) [web](https://x.org)\n"
        "[self](#top) [gone](docs/none.md) [no heading](docs/page.md#sharded) ![image](img.png)\n"
        "```\n[in code](docs/none.md)\n```\n`[inline](docs/none.md)`\n# Top\n"
    )
    assert dead_links(readme) == [
        "README.md: [gone](docs/none.md): no file docs/none.md",
        "README.md: [no heading](docs/page.md#sharded): no heading #sharded in page.md",
        "README.md: [image](img.png): no file img.png",
    ]
    assert slug("Recovering without leaving the allocation: `--spare-nodes K`") == (
        "recovering-without-leaving-the-allocation---spare-nodes-k"
    )
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_every_relative_link_of_the_docs_is_alive() -> None:
    checked = [link for path in documents() for link in links(path.read_text())]
    assert len(checked) > 50, f"only {len(checked)} links found: the parser misses some"
    dead = [line for path in documents() for line in dead_links(path)]
    assert dead == [], "dead links:\n" + "\n".join(dead)


def test_the_readme_is_short_and_no_line_is_too_wide() -> None:
    count = len((ROOT / "README.md").read_text().splitlines())
    assert count <= README_LINES, (
        f"README.md has {count} lines, at most {README_LINES}: move reference to docs/"
    )
    wide = [
        f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
        for path in documents()
        for number, line in enumerate(prose(path.read_text()).splitlines(), 1)
        if len(line) > LINE_CHARS
    ]
    assert wide == [], (
        f"lines over {LINE_CHARS} characters (wrap them; a table row too long: a list):\n" + "\n".join(wide)
    )


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
