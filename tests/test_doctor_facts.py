"""The doctor's probes on this host (machine identity, ports, the folder marker) and the facts' round trip."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from test_doctor_rules import rank

from hpc_ddp.doctor import facts as probes
from hpc_ddp.doctor.facts import RankFacts

# ---- probes on this host -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"/etc/machine-id": "abc", "/proc/sys/kernel/random/boot_id": "b00t"}, "abc/b00t"),
        ({"/var/lib/dbus/machine-id": "dbus", "/proc/sys/kernel/random/boot_id": "b00t"}, "dbus/b00t"),
        ({"/proc/sys/kernel/random/boot_id": "b00t"}, "b00t"),
        ({}, "host:node7"),  # a bare container: the host name is the best left
    ],
)
def test_machine_identity(files: dict[str, str], expected: str) -> None:
    assert probes.machine_identity(lambda path: files.get(path, ""), hostname="node7") == expected


def test_port_probe_sees_a_listener_and_a_free_port() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert "in use" in probes.port_in_use(port)
    assert probes.port_in_use(port) == ""  # closed again (SO_REUSEADDR: TIME_WAIT does not count)


def test_marker_tells_a_shared_folder_from_a_node_local_one(tmp_path: Path) -> None:
    shared, elsewhere = tmp_path / "run", tmp_path / "other"
    elsewhere.mkdir()
    assert probes.missing_dirs(shared / "a" / "b") == [shared / "a" / "b", shared / "a", shared]
    assert probes.write_marker(shared, "n0nce") == ""
    assert probes.read_marker(shared, "n0nce") == "seen"
    assert probes.read_marker(elsewhere, "n0nce") == "missing"
    assert probes.read_marker(tmp_path / "absent", "n0nce") == "folder missing on this node"
    assert probes.write_probe(shared, 3, "n0nce") == ""
    assert os.listdir(shared) == [".hpc_ddp-doctor-n0nce"]  # the probe is gone, the marker stays
    probes.remove_marker(shared, "n0nce", [shared])
    assert not shared.exists()  # the doctor made it, the doctor removes it


def test_facts_survive_the_trip_through_the_store() -> None:
    facts = rank(2, environ={"OMP_NUM_THREADS": "1"})
    assert RankFacts.from_json(facts.to_json()) == facts
