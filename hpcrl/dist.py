"""Bootstrap torch.distributed over an MPI communicator (torch has no MPI backend built in).

Rank 0 of `comm` opens the rendezvous store on a port the OS picks and broadcasts (host, port) over
MPI; every rank then joins `init_process_group` with its MPI rank. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now. Only for servers that must be told their port (SGLang's --port): between this
    call and the server's bind another process may take it; a store we open ourselves uses
    master_store instead, which binds port 0 and keeps the socket."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_block(host: str = "127.0.0.1", count: int = 1, tries: int = 64) -> int:
    """A port p with p .. p + count - 1 all free now (as `free_port`), for a server that takes the
    ports after the one it is told (SGLang's --dist-init-addr: the 6 after it under DP attention,
    server_args.py PortArgs.init_new). RuntimeError after `tries` candidates."""
    for _ in range(tries):
        first = free_port(host)
        if first + count - 1 > 65535:
            continue
        held = []
        try:
            for port in range(first, first + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no block of {count} free ports on {host} in {tries} tries")


IFNAME_ENV = "HPCRL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class NetworkInterfaceError(ValueError):
    """HPCRL_SOCKET_IFNAME names no interface with an IPv4 address on this host."""


def routable_host() -> str:
    """An address other hosts of the job can reach this one at.

    In order: the address of the interface HPCRL_SOCKET_IFNAME names; the address the host name
    resolves to, unless that is a loopback address (Debian-style /etc/hosts map the name to 127.0.1.1,
    which every other node would take for its own); the address of the interface the default route
    leaves by; loopback when the host has none of these (a single-host run).
    """
    ifname = os.environ.get(IFNAME_ENV)
    if ifname:
        return interface_address(ifname)
    named = _named_address()
    if not ipaddress.ip_address(named).is_loopback:
        return named
    return default_route_address() or named


def on_loopback(host: str) -> bool:
    """Whether `host` (a name, an address, [IPv6] or empty for this host) is a loopback address."""
    host = host.strip("[]") or "localhost"
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0]).is_loopback
    except (OSError, ValueError):
        return False


def _named_address() -> str:
    """The address the host name resolves to (loopback when it resolves to none)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def default_route_address() -> str | None:
    """The local address outgoing packets to other networks leave from, or None without a route.

    Connecting a UDP socket sends nothing; the kernel only picks the route and the source address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3 (RFC 5737): off every local subnet
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if ipaddress.ip_address(addr).is_loopback or addr == "0.0.0.0" else addr


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface `ifname` (e.g. ib0, eth0) on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            have = [name for _, name in socket.if_nameindex()]
            raise NetworkInterfaceError(
                f"{IFNAME_ENV}={ifname!r}: this host ({socket.gethostname()}) has no interface of that name "
                f"with an IPv4 address; its interfaces are {have}. Set it to the interface the job's nodes "
                f"reach each other over (`ip -4 addr` lists them), or unset it to use the host name's "
                f"address") from None
    return socket.inet_ntoa(packed[20:24])


def default_route_interface() -> str | None:
    """The name of the interface default_route_address belongs to, or None."""
    addr = default_route_address()
    for _, name in socket.if_nameindex() if addr else ():
        try:
            if interface_address(name) == addr:
                return name
        except NetworkInterfaceError:
            continue
    return None


def export_socket_ifname(spans_hosts: bool) -> None:
    """Tell gloo and NCCL which interface to use, unless GLOO/NCCL_SOCKET_IFNAME already do.

    HPCRL_SOCKET_IFNAME's interface when set. Otherwise gloo binds the address the host name resolves
    to: where that is loopback (Debian-style hosts) and the group spans hosts, the default route's
    interface instead. NCCL leaves loopback out by itself."""
    ifname = os.environ.get(IFNAME_ENV)
    if ifname:
        interface_address(ifname)  # a wrong name fails here, named, not inside gloo
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    elif spans_hosts and "GLOO_SOCKET_IFNAME" not in os.environ \
            and ipaddress.ip_address(_named_address()).is_loopback:
        routed = default_route_interface()
        if routed:
            os.environ["GLOO_SOCKET_IFNAME"] = routed


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
    export_socket_ifname(spans_hosts=len(set(comm.allgather(socket.gethostname()))) > 1)
    addr, store = None, None
    if rank == 0:
        host = routable_host() if world > 1 else "127.0.0.1"
        store = master_store(host, world, timeout_s)
        addr = (host, store.port)
    host, port = comm.bcast(addr, root=0)
    if store is None:
        store = joined_store(f"tcp://{host}:{port}", world, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
