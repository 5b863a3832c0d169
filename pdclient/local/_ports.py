"""Loopback ports for LocalPD's servers that nothing else on the machine will take.

A port handed out by the kernel (bind to 0) lies in its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range every socket the vLLM
server opens itself draws from: its worker binds many (UCX, gloo, ZMQ), and one of them
can take the NIXL side-channel port between our choice and the server's bind (seen:
``zmq.error.ZMQError: Address already in use`` from the handshake listener). So every
port LocalPD picks is taken from outside that range, and is

- free when chosen (a bind test on the loopback address the servers use);
- distinct from the others chosen for the same pair and from its explicit ports;
- claimed machine-wide until the pair stops, against other LocalPDs choosing at the same
  moment (in this or another process, whatever their cache dir): a claim is a bound
  Linux abstract-namespace socket ``\\0pdclient-port-<port>``, which the kernel releases
  when its holder closes it or dies, so a crashed owner leaves no stale claim;
- searched from a random start, so concurrent choosers seldom even meet.

What is left is a port bound by an unrelated program between the bind test and the
server's own bind: LocalPD sees that in the server log and retries once with new ports.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
from collections.abc import Collection, Sequence
from pathlib import Path

from .._errors import PDSetupError

logger = logging.getLogger("pdclient.local")

HOST = "127.0.0.1"
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default, for systems without the file.
DEFAULT_EPHEMERAL = (32768, 60999)
# Below this, ports that services and developers habitually pick by hand (8000, 8080, 9090...).
LOWEST = 10000
HIGHEST = 65535

_rng = random.Random()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), inclusive."""
    try:
        first, last = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return first, last


def candidate_ranges(ephemeral: tuple[int, int], low: int = LOWEST, high: int = HIGHEST) -> list[range]:
    """The parts of [low, high] outside the ephemeral range."""
    first, last = ephemeral
    parts = [range(low, min(first, high + 1)), range(max(last + 1, low), high + 1)]
    return [r for r in parts if len(r) > 0]


def is_free(port: int) -> bool:
    """Whether ``HOST:port`` can be bound right now (no SO_REUSEADDR: a port in TIME_WAIT counts as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


class PortClaim:
    """A machine-wide claim on one port among pdclient processes, held until ``release()``."""

    def __init__(self, port: int, sock: socket.socket | None) -> None:
        self.port = port
        self._sock = sock

    @classmethod
    def take(cls, port: int) -> PortClaim | None:
        """The claim, or None when another holder has it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0pdclient-port-{port}")
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                return None
            # No abstract namespace (not Linux): the bind test alone decides.
            return cls(port, None)
        return cls(port, sock)

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        return f"PortClaim({self.port}, held={self._sock is not None})"


def claim_ports(
    count: int,
    *,
    avoid: Collection[int] = (),
    ranges: Sequence[range] | None = None,
    rng: random.Random | None = None,
) -> list[PortClaim]:
    """``count`` distinct free ports outside the ephemeral range, each claimed.

    The search walks the candidate ports once, from a random start, skipping ``avoid``,
    ports another pdclient process has claimed and ports that do not bind.
    """
    ranges = candidate_ranges(ephemeral_range()) if ranges is None else ranges
    total = sum(len(r) for r in ranges)
    claims: list[PortClaim] = []
    if total:
        start = (rng or _rng).randrange(total)
        for i in range(total):
            port = _nth(ranges, (start + i) % total)
            if port in avoid:
                continue
            claim = PortClaim.take(port)
            if claim is None:
                continue
            if not is_free(port):
                claim.release()
                continue
            claims.append(claim)
            if len(claims) == count:
                return claims
    for claim in claims:
        claim.release()
    raise PDSetupError(
        f"found only {len(claims)} of {count} free loopback ports outside the ephemeral range "
        f"{ephemeral_range()} (searched {[(r.start, r.stop - 1) for r in ranges]}); "
        "pass explicit ports or widen the range below it"
    )


def _nth(ranges: Sequence[range], index: int) -> int:
    for r in ranges:
        if index < len(r):
            return r[index]
        index -= len(r)
    raise IndexError(index)
