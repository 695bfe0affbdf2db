"""Slurm hostlist expansion (``SLURM_JOB_NODELIST``) and ``SLURM_TASKS_PER_NODE`` parsing.

Pure standard library, so it works inside containers where ``scontrol`` is missing
(the usual reason launchers fall back to a wrong MASTER_ADDR).

Grammar, as Slurm's ``scontrol show hostnames`` reads it::

    hostlist := item ("," item)*          commas inside brackets do not split
    item     := (text | "[" ranges "]")+  text: any chars except "[", "]", ",", whitespace
    ranges   := range ("," range)*
    range    := digits | digits "-" digits

* Zero padding: a range is printed with the width of its lower bound as written,
  so ``gpu[001-010]`` gives ``gpu001 .. gpu010`` and ``n[1-10]`` gives ``n1 .. n10``.
* Several bracket groups in one item expand as a Cartesian product, first group
  varying slowest: ``n[1-2]-ib[3-4]`` -> n1-ib3, n1-ib4, n2-ib3, n2-ib4.
* Order is kept as written (``h[5-9,1]`` -> h5 .. h9, h1) and so are duplicates,
  because ``scontrol show hostnames`` does not sort or deduplicate either.
* Whitespace around items is stripped. Stricter than Slurm on purpose: empty
  items, nested/unbalanced/empty brackets, reversed or non-numeric ranges, a
  dangling ``-`` and lists of more than ``MAX_HOSTS`` hosts raise ``HostlistError``
  instead of being guessed at. Positions in error messages are 0-based indexes
  into the whole string.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator

__all__ = ["HostlistError", "MAX_HOSTS", "expand", "first", "iter_hosts", "parse_tasks_per_node"]

# Same cap as python-hostlist: a typo such as n[1-9999999] must fail, not eat the RAM.
MAX_HOSTS = 100_000

# [0-9], not \d: \d also matches non-ASCII digits, which int() would quietly accept.
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")

# An item is a sequence of parts: literal text, or a bracket group given as
# (lo, hi, width) ranges. Kept unexpanded so sizes can be checked before expanding.
_Group = list[tuple[int, int, int]]
_Part = str | _Group


class HostlistError(ValueError):
    """A malformed Slurm hostlist or tasks-per-node string."""


def _fail(kind: str, text: str, why: str) -> HostlistError:
    return HostlistError(f"invalid Slurm {kind} {text!r}: {why}")


def _split_top(nodelist: str) -> list[tuple[int, str]]:
    """Split on commas outside brackets; return (start position, raw item) pairs."""
    items, depth, start = [], 0, 0
    for pos, ch in enumerate(nodelist):
        if ch == "[":
            if depth:
                raise _fail("hostlist", nodelist, f"nested '[' at position {pos}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _fail("hostlist", nodelist, f"unmatched ']' at position {pos}")
            depth = 0
        elif ch == "," and not depth:
            items.append((start, nodelist[start:pos]))
            start = pos + 1
    if depth:
        raise _fail("hostlist", nodelist, f"unclosed '[' at position {nodelist.rindex('[')}")
    items.append((start, nodelist[start:]))
    return items


def _parse_item(nodelist: str, start: int, item: str) -> list[_Part]:
    """Cut one top-level item (brackets already known to be balanced) into parts."""
    parts: list[_Part] = []
    pos = start
    for chunk in re.split(r"(\[[^\]]*\])", item):
        at, pos = pos, pos + len(chunk)
        if not chunk.startswith("["):
            if any(c.isspace() for c in chunk):
                raise _fail("hostlist", nodelist, f"whitespace inside host name {item!r}")
            if chunk:
                parts.append(chunk)
            continue
        group: _Group = []
        for spec in chunk[1:-1].split(","):
            m = _RANGE.fullmatch(spec)
            if not m:
                why = "empty range" if not spec else f"bad range {spec!r} (want N or N-M)"
                raise _fail("hostlist", nodelist, f"{why} in {chunk!r} at position {at}")
            lo, hi = int(m[1]), int(m[2] or m[1])
            if lo > hi:
                why = f"reversed range {spec!r} in {chunk!r} at position {at}"
                raise _fail("hostlist", nodelist, why)
            group.append((lo, hi, len(m[1])))
        parts.append(group)
    if not parts:
        raise _fail("hostlist", nodelist, f"empty item at position {start}")
    return parts


def _parse(nodelist: str) -> list[list[_Part]]:
    """Validate the whole list and its size up front, so errors never surface mid-expansion."""
    if not nodelist.strip():
        raise _fail("hostlist", nodelist, "empty")
    items = []
    for start, raw in _split_top(nodelist):
        lead = len(raw) - len(raw.lstrip())
        items.append(_parse_item(nodelist, start + lead, raw.strip()))
    total = sum(
        math.prod(sum(hi - lo + 1 for lo, hi, _ in p) for p in parts if isinstance(p, list))
        for parts in items
    )
    if total > MAX_HOSTS:
        raise _fail("hostlist", nodelist, f"expands to {total} hosts, more than {MAX_HOSTS}")
    return items


def _choices(part: _Part) -> list[str]:
    if isinstance(part, str):
        return [part]
    return [f"{n:0{width}d}" for lo, hi, width in part for n in range(lo, hi + 1)]


def iter_hosts(nodelist: str) -> Iterator[str]:
    """Yield hosts in Slurm order; the whole string is validated before the first yield."""
    items = _parse(nodelist)

    def gen() -> Iterator[str]:
        for parts in items:
            # product() varies its last argument fastest: the first group is slowest, as in Slurm.
            for combo in itertools.product(*map(_choices, parts)):
                yield "".join(combo)

    return gen()


def expand(nodelist: str) -> list[str]:
    """``expand("gpu[01-02],cpu1")`` -> ``['gpu01', 'gpu02', 'cpu1']``."""
    return list(iter_hosts(nodelist))


def first(nodelist: str) -> str:
    """The first host (the MASTER_ADDR candidate); validates everything, expands one host."""
    return next(iter_hosts(nodelist))


def parse_tasks_per_node(value: str) -> list[int]:
    """``SLURM_(STEP_)TASKS_PER_NODE`` form: ``"4(x2),2"`` -> ``[4, 4, 2]``."""
    counts: list[int] = []
    for spec in value.split(","):
        m = _TASKS.fullmatch(spec.strip())
        if not m:
            raise _fail("tasks-per-node", value, f"bad item {spec!r} (want N or N(xR))")
        repeat = int(m[2] or 1)
        if repeat < 1:
            raise _fail("tasks-per-node", value, f"repeat must be >= 1 in {spec!r}")
        if len(counts) + repeat > MAX_HOSTS:
            raise _fail("tasks-per-node", value, f"more than {MAX_HOSTS} nodes")
        counts += [int(m[1])] * repeat
    return counts
