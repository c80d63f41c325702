"""aihpc's port choice stays out of the kernel's ephemeral range, where torchelastic draws each
restarted group's MASTER_PORT (the EADDRINUSE race a restart test once hit)."""

from __future__ import annotations

import socket
from pathlib import Path

from aihpc._net import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = int(RANGE.read_text().split()[0]) if RANGE.exists() else None
    for count in (1, 3):
        port = free_port(count)
        if low is not None and low > 10000 + count:
            assert port + count <= low, (port, count, low)
        held = []
        try:
            for p in range(port, port + count):  # every port of the run can be bound now
                s = socket.socket()
                s.bind(("0.0.0.0", p))
                held.append(s)
        finally:
            for s in held:
                s.close()
