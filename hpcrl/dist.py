"""Bootstrap torch.distributed over an MPI communicator (torch has no MPI backend built in).

Rank 0 of `comm` opens the rendezvous store on a port the OS picks and broadcasts (host, port) over
MPI; every rank then joins `init_process_group` with its MPI rank. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now. Only for servers that must be told their port (SGLang's --port): between this
    call and the server's bind another process may take it; a store we open ourselves uses
    master_store instead, which binds port 0 and keeps the socket."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def routable_host() -> str:
    """An address other hosts of the job can reach this one at (loopback when single-host)."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


def master_store(host: str, world_size: int, timeout_s: float) -> Any:
    """The rendezvous store of a new group, listening from now on at (host, store.port).

    The OS picks the port at bind time and the socket stays open, so no other process can take it
    between choosing and listening (free_port then a later bind raced outgoing connections for it:
    EADDRINUSE in CI). The other ranks join with tcp://host:port.
    """
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def joined_store(init_method: str, world_size: int, timeout_s: float) -> Any:
    """A client of the store another process hosts at init_method (tcp://host:port) -- for a group's
    rank 0 when the store is not its own (tests host it in the test process)."""
    import torch.distributed as dist

    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(host, int(port), world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_torch_distributed(comm, backend: str, timeout_s: float = 300.0) -> None:  # comm: mpi4py Comm
    """Make `comm`'s ranks the default torch.distributed world (rank = comm rank)."""
    import torch.distributed as dist

    rank, world = comm.Get_rank(), comm.Get_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    addr, store = None, None
    if rank == 0:
        host = routable_host() if world > 1 else "127.0.0.1"
        store = master_store(host, world, timeout_s)
        addr = (host, store.port)
    host, port = comm.bcast(addr, root=0)
    if store is None:
        store = joined_store(f"tcp://{host}:{port}", world, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
