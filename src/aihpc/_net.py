"""A free TCP port on this host, chosen where the kernel's own choices never land.

Binding port 0 and closing the socket hands out a port from the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default) that stays free only until someone
binds it. torchelastic picks each restarted worker group's ``MASTER_PORT`` exactly that way, so
any other port picked the same way in the gap (a second job, a test beside it) can take it
first, and the restarted group dies with EADDRINUSE. Ports below the ephemeral range are never
handed out by the kernel: drawing ours there leaves only collisions between our own draws,
which a random draw over some twenty thousand ports makes rare, and a bind test rules out the
ports in use now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 10000  # clear of the well-known and common service ports
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems: the same or higher (IANA 49152)
    return low


def _bindable(port: int, count: int) -> bool:
    try:
        for p in range(port, port + count):
            with socket.socket() as s:
                s.bind(("0.0.0.0", p))
    except OSError:
        return False
    return True


def free_port(count: int = 1) -> int:
    """A port P with P .. P + count - 1 free on every interface, below the ephemeral range
    when the host leaves room there (else one the kernel chooses)."""
    top = _ephemeral_low() - count
    draw = random.SystemRandom()
    for _ in range(200) if top > _LOWEST else ():
        port = draw.randint(_LOWEST, top)
        if _bindable(port, count):
            return port
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count <= 65536 and _bindable(port, count):
            return port
    raise OSError("no free TCP port on this host")
