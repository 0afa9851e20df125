"""Bootstrap torch.distributed over an MPI communicator (torch has no MPI backend built in).

Rank 0 of `comm` picks a free TCP port and broadcasts (host, port) over MPI; every rank then joins
`init_process_group` with its MPI rank. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import socket


def free_port(host: str = "127.0.0.1") -> int:
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


def init_torch_distributed(comm, backend: str, timeout_s: float = 300.0) -> None:  # comm: mpi4py Comm
    """Make `comm`'s ranks the default torch.distributed world (rank = comm rank)."""
    import torch.distributed as dist

    addr = None
    if comm.Get_rank() == 0:
        host = routable_host() if comm.Get_size() > 1 else "127.0.0.1"
        addr = (host, free_port())
    host, port = comm.bcast(addr, root=0)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=timeout_s))
