"""How the lab tells that a process it started serves: a server without HTTP (the rsyslog relay) once it
holds its UDP port, so that nginx's first log lines are not sent before the relay listens."""

from __future__ import annotations

import socket

from kvwatch.lab.process import Process
from kvwatch.lab.supervisor import _serves


def test_a_udp_server_serves_once_it_holds_its_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        assert _serves(Process("relay", ["true"], None, ready_udp_port=port))
    assert not _serves(Process("relay", ["true"], None, ready_udp_port=port))
