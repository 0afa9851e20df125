"""Doorbells: a one-byte UDP datagram that wakes a rank waiting for an MPI message.

The control plane polls MPI without blocking (a blocking MPI wait spins a core, which the 2-core
laptop case cannot spare) and sleeps between polls. A sleeping rank would notice a message only at
its next poll, which costs about 2 ms per hop on a loaded machine, several hops per step. So every
sender rings the receiver's doorbell right after posting the message, and a waiting rank sleeps in
`select` on its doorbell socket instead of `time.sleep`: it wakes as soon as a message is there,
and idles without spinning otherwise. MPI still carries every message; a lost or late datagram only
delays the wake-up to the next poll.
"""

from __future__ import annotations

import select
import socket

Address = tuple[str, int]


class Doorbell:
    """This rank's doorbell: a non-blocking UDP socket on all interfaces, an ephemeral port."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]

    def ring(self, address: Address) -> None:
        """Wake the rank at `address`; best effort (a full buffer or an unreachable host is ignored)."""
        try:
            self._sock.sendto(b"\x01", address)
        except OSError:
            pass

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a ring arrives or `timeout_s` passes; True if rung. Drains every pending ring."""
        ready, _, _ = select.select([self._sock], [], [], max(timeout_s, 0.0))
        if not ready:
            return False
        try:
            while self._sock.recv(64):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        return True

    def close(self) -> None:
        self._sock.close()
