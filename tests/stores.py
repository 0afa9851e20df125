"""Rendezvous for the processes a test spawns, without a port race.

A port picked free (hpcrl.dist.free_port) and bound later by a child can be taken in between by any
outgoing connection (CI saw EADDRINUSE that way). Here the test process hosts the store on a port
the OS picks at bind time and keeps it open; the children join it as clients.
"""

from __future__ import annotations

import torch.distributed as dist

from hpcrl.dist import joined_store as _joined, master_store

HOST = "127.0.0.1"


def hosted_store(world_size: int, timeout_s: float = 180.0) -> dist.TCPStore:
    """The store the children join (keep it referenced until they have): pass `.port` (or
    `init_method(store)` to a script whose rank 0 joins with hpcrl.dist.joined_store)."""
    return master_store(HOST, world_size, timeout_s)


def init_method(store: dist.TCPStore) -> str:
    return f"tcp://{HOST}:{store.port}"


def joined_store(port: int, world_size: int, timeout_s: float = 180.0) -> dist.TCPStore:
    """A child's client of the test process's store (for init_process_group(store=...))."""
    return _joined(f"tcp://{HOST}:{port}", world_size, timeout_s)
