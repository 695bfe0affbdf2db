"""The doctor's report: one table of what each rank derived, the bus-bandwidth table, and a PASS / WARN / FAIL
line per check with its fix. Pure: text from data, printed by rank 0 (hpc_ddp.doctor.checkup)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.doctor import collective
from hpc_ddp.doctor.facts import RankFacts
from hpc_ddp.doctor.rules import FAIL, PASS, WARN, Check, ranks_text

ROW = "{:>5} {:>5} {:>4}  {:<14} {:<8} {:<22} {:<8} {:<9} {:>7}"


def cpu_list(cpus: Sequence[int]) -> str:
    return ranks_text(cpus).replace(", ", ",")


def machine_label(key: str) -> str:
    """A short stable name for a machine key (the machine-id is long and not for display)."""
    return hashlib.sha1(key.encode()).hexdigest()[:6]


def render_rows(facts: Sequence[RankFacts]) -> list[str]:
    lines = [ROW.format("rank", "local", "node", "host", "machine", "master", "device", "cpus", "threads")]
    for f in facts:
        lines.append(
            ROW.format(
                f.rank,
                f.local_rank,
                f.node_rank,
                f.host[:14],
                machine_label(f.machine),
                f"{f.master_addr}:{f.master_port}"[:22],
                f.device or "refused",
                cpu_list(f.cpus)[:9],
                f.threads,
            )
        )
    return lines


def render_checks(results: Sequence[Check]) -> str:
    width = max((len(c.name) for c in results), default=0) + 2
    lines = []
    for c in results:
        lines.append(f"{c.status}  {c.name:<{width}}{c.reason}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':6}{'':<{width}}fix: {c.fix}")
    return "\n".join(lines)


def render_bench(times: Mapping[int, Mapping[int, float]], world: int, backend: str) -> list[str]:
    lines = [
        f"all-reduce over {backend}, {world} rank(s), float32; busbw = algbw * 2(n-1)/n (nccl-tests)",
        f"{'size':>8} {'calls':>6} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}",
    ]
    for size, mean, algbw, busbw in collective.table(times, world):
        lines.append(
            f"{collective.human_size(size):>8} {collective.iterations(size):>6} {mean * 1e6:>11.1f} "
            f"{algbw:>13.3f} {busbw:>13.3f}"
        )
    return lines


def render(env: Any, facts: Sequence[RankFacts], results: Sequence[Check], bench: Sequence[str] = ()) -> str:
    machines = len({f.machine for f in facts})
    head = (
        f"hpc_ddp doctor: {env.world_size} rank(s) on {env.num_nodes} node(s), {machines} machine(s) "
        f"seen, launcher {env.launcher}" + (f", job {env.job_id}" if env.job_id else "")
    )
    lines = [head, *(f"using {o} from the environment" for o in env.overrides), *render_rows(facts), ""]
    lines += [*bench, ""] if bench else []
    lines.append(render_checks(results))
    counts = {s: sum(c.status == s for c in results) for s in (FAIL, WARN, PASS)}
    lines.append(
        f"doctor: {counts[FAIL]} FAIL, {counts[WARN]} WARN, {counts[PASS]} PASS"
        + (" -> exit 1" if counts[FAIL] else "")
    )
    return "\n".join(lines)
