"""The address a rank advertises to other hosts (hpcrl.dist.routable_host).

On Debian-style hosts /etc/hosts maps the host name to 127.0.1.1; a rank that advertised it would send
every other node to its own loopback."""

import os
import socket
import subprocess
import sys

import pytest

from hpcrl import dist


@pytest.fixture
def no_ifname(monkeypatch):
    monkeypatch.delenv(dist.IFNAME_ENV, raising=False)


def test_a_host_name_on_loopback_gives_the_default_routes_address(monkeypatch, no_ifname):
    monkeypatch.setattr(dist.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(dist, "default_route_address", lambda: "10.1.2.3")
    assert dist.routable_host() == "10.1.2.3"


def test_a_host_name_off_loopback_wins(monkeypatch, no_ifname):
    monkeypatch.setattr(dist.socket, "gethostbyname", lambda name: "10.9.9.9")
    monkeypatch.setattr(dist, "default_route_address", lambda: "10.1.2.3")
    assert dist.routable_host() == "10.9.9.9"


def test_without_a_route_a_single_host_keeps_loopback(monkeypatch, no_ifname):
    monkeypatch.setattr(dist.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(dist, "default_route_address", lambda: None)
    assert dist.routable_host() == "127.0.1.1"


def test_the_default_route_address_is_one_of_this_hosts():
    addr = dist.default_route_address()
    if addr is None:
        pytest.skip("this host has no route off its own subnets")
    ours = {dist.interface_address(name) for _, name in socket.if_nameindex() if _has_ipv4(name)}
    assert addr in ours, (addr, ours)
    with socket.socket() as server:  # and this host's processes reach each other at it
        server.bind((addr, 0))
        server.listen(1)
        socket.create_connection(server.getsockname(), timeout=5).close()


def test_the_default_route_interface_holds_its_address():
    addr = dist.default_route_address()
    if addr is None:
        pytest.skip("this host has no route off its own subnets")
    assert dist.interface_address(dist.default_route_interface()) == addr


@pytest.fixture
def no_gloo_ifname(monkeypatch, no_ifname):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "restored after the test")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(dist, "default_route_interface", lambda: "eth9")


@pytest.mark.parametrize(("named", "spans_hosts", "gloo"), [
    ("127.0.1.1", True, "eth9"),  # gloo would bind loopback: the default route's interface instead
    ("127.0.1.1", False, None),   # one host: loopback serves
    ("10.9.9.9", True, None),     # gloo binds the name's address, which other nodes reach
])
def test_gloo_leaves_loopback_only_when_the_group_spans_hosts(monkeypatch, no_gloo_ifname, named,
                                                               spans_hosts, gloo):
    monkeypatch.setattr(dist.socket, "gethostbyname", lambda name: named)
    dist.export_socket_ifname(spans_hosts)
    assert os.environ.get("GLOO_SOCKET_IFNAME") == gloo


def test_loopback_hosts():
    assert all(map(dist.on_loopback, ["127.0.0.1", "127.0.1.1", "localhost", "", "[::1]"]))
    assert not any(map(dist.on_loopback, ["10.1.2.3", "[fd00::2]", "no-such-host.invalid"]))


def _has_ipv4(name: str) -> bool:
    try:
        dist.interface_address(name)
    except dist.NetworkInterfaceError:
        return False
    return True


def test_the_named_interface_decides(monkeypatch):
    monkeypatch.setenv(dist.IFNAME_ENV, "lo")
    monkeypatch.setattr(dist.socket, "gethostbyname", lambda name: "10.9.9.9")
    assert dist.routable_host() == "127.0.0.1"


def test_an_unknown_interface_is_named_with_the_ones_there(monkeypatch):
    monkeypatch.setenv(dist.IFNAME_ENV, "nosuch0")
    with pytest.raises(dist.NetworkInterfaceError) as err:
        dist.routable_host()
    msg = str(err.value)
    assert "HPCRL_SOCKET_IFNAME='nosuch0'" in msg and "'lo'" in msg and "ip -4 addr" in msg


def test_the_named_interface_reaches_gloo_and_nccl_unless_they_are_set():
    code = ("import os; from hpcrl import dist; dist.export_socket_ifname(spans_hosts=False); "
            "print(os.environ.get('GLOO_SOCKET_IFNAME'), os.environ.get('NCCL_SOCKET_IFNAME'))")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}

    def run(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                              text=True, timeout=60, check=False)

    assert run(HPCRL_SOCKET_IFNAME="lo").stdout.split() == ["lo", "lo"]
    assert run(HPCRL_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="ib0").stdout.split() == ["lo", "ib0"]
    assert run().stdout.split() == ["None", "None"]
    bad = run(HPCRL_SOCKET_IFNAME="nosuch0")
    assert bad.returncode != 0 and "NetworkInterfaceError" in bad.stderr
