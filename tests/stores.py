"""Rendezvous for the processes a test spawns, without a port race.

A port picked free (hpcrl.dist.free_port) and bound later by a child can be taken in between by any
outgoing connection (CI saw EADDRINUSE that way). Here the test process hosts the store on a port
the OS picks at bind time and keeps it open; the children join it as clients.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from hpcrl.dist import master_store

HOST = "127.0.0.1"


def hosted_store(world_size: int, timeout_s: float = 180.0) -> dist.TCPStore:
    """The store the children join (keep it referenced until they have): pass `.port` to them."""
    return master_store(HOST, world_size, timeout_s)


def joined_store(port: int, world_size: int, timeout_s: float = 180.0) -> dist.TCPStore:
    """A child's client of the test process's store (for init_process_group(store=...))."""
    return dist.TCPStore(HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
