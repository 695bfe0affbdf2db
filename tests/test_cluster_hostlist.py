"""Tests for hpc_ddp.cluster.hostlist: Slurm hostlist expansion and tasks-per-node parsing."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from hpc_ddp.cluster.hostlist import MAX_HOSTS, HostlistError, expand, first, iter_hosts, parse_tasks_per_node

# (hostlist, expected expansion). The first six rows are the "Hostlist parser check" table
# of notes/anchors.md; Lightning's regex returns only "node1" / "rack1" for rows 5 and 6.
EXPAND_CASES = [
    ("gpu-a[001-003,010],gpu-b7", ["gpu-a001", "gpu-a002", "gpu-a003", "gpu-a010", "gpu-b7"]),
    ("alpha,beta,gamma", ["alpha", "beta", "gamma"]),
    ("linux[1,2]", ["linux1", "linux2"]),
    ("jean-zay-ia[810-812]", ["jean-zay-ia810", "jean-zay-ia811", "jean-zay-ia812"]),
    ("node[1-2]-ib[3-4]", ["node1-ib3", "node1-ib4", "node2-ib3", "node2-ib4"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    # the spec's other examples
    ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
    ("gpu[001-010]", [f"gpu{i:03d}" for i in range(1, 11)]),
    ("host[5-9,1]", ["host5", "host6", "host7", "host8", "host9", "host1"]),
    ("a.b-c[1-2]", ["a.b-c1", "a.b-c2"]),
    ("127.0.0.[1-3]", ["127.0.0.1", "127.0.0.2", "127.0.0.3"]),
    ("n[1-2]x", ["n1x", "n2x"]),
    # error-prone shapes from the pain-point threads (Lightning #1943, scoop #26, mpich #2786)
    ("node-12", ["node-12"]),
    ("nodes[006,011]", ["nodes006", "nodes011"]),
    ("host-[001-002]", ["host-001", "host-002"]),
    # width is that of the lower bound as written, as in Slurm
    ("n[1-10]", [f"n{i}" for i in range(1, 11)]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[98-101]", ["n98", "n99", "n100", "n101"]),
    ("n[0]", ["n0"]),
    ("n[7]", ["n7"]),
    ("[1-2]", ["1", "2"]),
    ("n[1-2]-[3]x", ["n1-3x", "n2-3x"]),
    # three groups: first varies slowest
    ("r[1-2]c[1-2]n[1-2]", [f"r{r}c{c}n{n}" for r in (1, 2) for c in (1, 2) for n in (1, 2)]),
    # duplicates are kept, like `scontrol show hostnames`
    ("a,a", ["a", "a"]),
    ("n[1-2],n[2-3]", ["n1", "n2", "n2", "n3"]),
    # whitespace around top-level items is stripped
    (" a , b[1-2] ", ["a", "b1", "b2"]),
    ("single", ["single"]),
]


@pytest.mark.parametrize(("nodelist", "hosts"), EXPAND_CASES)
def test_expand(nodelist: str, hosts: list[str]) -> None:
    assert expand(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "hosts"), EXPAND_CASES)
def test_first(nodelist: str, hosts: list[str]) -> None:
    assert first(nodelist) == hosts[0]


def test_first_is_lazy() -> None:
    # MAX_HOSTS hosts are allowed; first() must not build the whole list.
    it = iter_hosts(f"n[1-{MAX_HOSTS}]")
    assert next(it) == "n1"
    assert first(f"big[0-{MAX_HOSTS - 1}]") == "big0"


def test_first_validates_the_whole_list() -> None:
    with pytest.raises(HostlistError, match=re.escape("'good,bad[1-'")):
        first("good,bad[1-")


# (bad string, what the message must say besides quoting the string)
EXPAND_ERRORS = [
    ("", "empty"),
    ("   ", "empty"),
    ("a,,b", "empty item at position 2"),
    ("a,", "empty item at position 2"),
    (",a", "empty item at position 0"),
    ("node[1-3", r"unclosed '\[' at position 4"),
    ("node1-3]", r"unmatched '\]' at position 7"),
    ("n[1-[2]]", r"nested '\[' at position 4"),
    ("n[]", r"empty range in '\[\]' at position 1"),
    ("n[1,]", r"empty range in '\[1,\]'"),
    ("n[3-1]", r"reversed range '3-1' in '\[3-1\]' at position 1"),
    ("n[a-b]", "bad range 'a-b'"),
    ("n[1-]", "bad range '1-'"),
    ("n[-1]", "bad range '-1'"),
    ("n[1-2-3]", "bad range '1-2-3'"),
    ("n[ 1]", "bad range ' 1'"),
    ("n[\u0661]", "bad range"),  # ARABIC-INDIC DIGIT ONE: int() would accept it
    ("a b", "whitespace inside host name 'a b'"),
    (f"n[1-{MAX_HOSTS + 1}]", f"expands to {MAX_HOSTS + 1} hosts, more than {MAX_HOSTS}"),
    ("n[1-1000]m[1-1000]", "expands to 1000000 hosts"),
    (f"a[1-{MAX_HOSTS}],b", f"expands to {MAX_HOSTS + 1} hosts"),
]


@pytest.mark.parametrize(("nodelist", "why"), EXPAND_ERRORS)
def test_expand_errors(nodelist: str, why: str) -> None:
    pattern = "invalid Slurm hostlist " + re.escape(repr(nodelist)) + ": .*" + why
    with pytest.raises(HostlistError, match=pattern):
        expand(nodelist)
    with pytest.raises(HostlistError, match=pattern):
        first(nodelist)


def test_hostlist_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        expand("n[")


TASKS_CASES = [
    ("4(x2),2", [4, 4, 2]),
    ("2", [2]),
    ("1(x3)", [1, 1, 1]),
    ("0(x2)", [0, 0]),
    ("8", [8]),
    ("2(x1)", [2]),
    ("3,1(x2),4", [3, 1, 1, 4]),
    (" 4(x2) , 2 ", [4, 4, 2]),
]


@pytest.mark.parametrize(("value", "counts"), TASKS_CASES)
def test_parse_tasks_per_node(value: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(value) == counts


TASKS_ERRORS = [
    ("4(x)", "bad item '4\\(x\\)'"),
    ("x", "bad item 'x'"),
    ("", "bad item ''"),
    ("4,,2", "bad item ''"),
    ("4(x0)", "repeat must be >= 1"),
    ("-1", "bad item '-1'"),
    ("4(2)", "bad item"),
    ("4(x2", "bad item"),
    (f"1(x{MAX_HOSTS + 1})", f"more than {MAX_HOSTS} nodes"),
]


@pytest.mark.parametrize(("value", "why"), TASKS_ERRORS)
def test_parse_tasks_per_node_errors(value: str, why: str) -> None:
    pattern = "invalid Slurm tasks-per-node " + re.escape(repr(value)) + ": .*" + why
    with pytest.raises(HostlistError, match=pattern):
        parse_tasks_per_node(value)


# --- cross-check against Slurm itself, when this machine has it ---------------------------

SCONTROL_LISTS = [
    "gpu-a[001-003,010],gpu-b7",
    "alpha,beta,gamma",
    "node[1-2]-ib[3-4]",
    "rack[1-2]-n[01-02]",
    "host[5-9,1]",
    "n[98-101]",
    "127.0.0.[1-3]",
    "a.b-c[1-2]",
    "a,a",
]
# Not cross-checked: "n[1-2]x". Slurm 22.05's scontrol calls a bare-letter suffix after a bracket invalid
# (while it accepts "node[1-2]-ib[3-4]"); expand() accepts it, a harmless superset for reading Slurm's output.


def _scontrol_hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()


@pytest.mark.slurm  # the real scontrol (elsewhere Slurm's commands are failing stand-ins: tests/standins.py)
@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol not installed")
@pytest.mark.parametrize("nodelist", SCONTROL_LISTS)
def test_matches_scontrol(nodelist: str, slurm_cluster: str) -> None:
    try:
        _scontrol_hostnames("probe[1-2]")
    except (subprocess.SubprocessError, OSError) as exc:  # e.g. no slurm.conf on this box
        pytest.skip(f"scontrol present but unusable: {exc}")
    assert expand(nodelist) == _scontrol_hostnames(nodelist)


# --- property: compressing numbered hosts into bracket form and expanding gives them back ---

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # optional dependency: skip only this test, not the whole module
    given = settings = st = None


def _compress(prefix: str, numbers: list[int], width: int) -> str:
    """Runs of consecutive numbers, in written order, become lo-hi ranges."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    fmt = f"0{width}d"
    specs = [f"{lo:{fmt}}" if lo == hi else f"{lo:{fmt}}-{hi:{fmt}}" for lo, hi in runs]
    return f"{prefix}[{','.join(specs)}]"


def _check_roundtrip(groups: list[tuple[str, list[int], int]]) -> None:
    nodelist = ",".join(_compress(p, nums, w) for p, nums, w in groups)
    hosts = [f"{p}{n:0{w}d}" for p, nums, w in groups for n in nums]
    assert expand(nodelist) == hosts
    assert first(nodelist) == hosts[0]


def test_compress_then_expand_examples() -> None:
    _check_roundtrip([("gpu", [1, 2, 3, 10, 9, 9], 3), ("b.", [0], 1)])


if st is None:

    @pytest.mark.skip(reason="hypothesis not installed")
    def test_compress_then_expand_roundtrip() -> None: ...

else:
    _groups = st.lists(
        st.tuples(
            st.text("abcxyz-._", min_size=1, max_size=6),
            st.lists(st.integers(0, 2000), min_size=1, max_size=30),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=4,
    )

    @settings(max_examples=300, deadline=None)
    @given(_groups)
    def test_compress_then_expand_roundtrip(groups: list[tuple[str, list[int], int]]) -> None:
        _check_roundtrip(groups)


def test_the_old_public_name_still_works_for_one_release() -> None:
    """hpc_ddp.dist.hostlist was public in 0.1; after the rename to hpc_ddp.cluster it keeps working, warning."""
    import importlib
    import sys

    sys.modules.pop("hpc_ddp.dist.hostlist", None)
    with pytest.warns(DeprecationWarning, match="hpc_ddp.cluster.hostlist"):
        old = importlib.import_module("hpc_ddp.dist.hostlist")
    assert old.expand("gpu[01-02]") == ["gpu01", "gpu02"]
    assert old.HostlistError is HostlistError
