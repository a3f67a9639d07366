"""Free TCP ports on 127.0.0.1 for the servers exitplan starts (tests, benchmarks, the coordinator cost probe).

A port found by binding to port 0 comes from the kernel's ephemeral range, the same range every later ``bind(0)``
and outgoing connection draws from: between the moment it is found and the moment its server binds it, another
process (a vLLM replica's internal sockets, say) can be handed the very same port, and the server dies with
"address already in use" (a CI failure of 2026-12-07). :func:`free_port` draws below that range instead, where the
kernel never hands a port out by itself, and never gives one process the same port twice.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux keeps the ephemeral range (``low high``)."""
LOWEST = 10_000
"""The lowest port :func:`free_port` draws (well above the registered services' usual ports)."""
_given: set[int] = set()
_lock = threading.Lock()


def port_is_free(port: int) -> bool:
    """Whether a server could bind ``port`` on 127.0.0.1 now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768, Linux's default, where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range, not given out before by this process.

    Raises:
        OSError: when no port of the range is free after many draws.
    """
    high = max(ephemeral_low(), LOWEST + 1000)
    rng = random.Random()
    with _lock:
        for _ in range(500):
            port = rng.randrange(LOWEST, high)
            if port not in _given and port_is_free(port):
                _given.add(port)
                return port
    raise OSError(f"no free port on 127.0.0.1 between {LOWEST} and {high}")
