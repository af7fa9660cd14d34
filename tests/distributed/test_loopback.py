"""A single-host parallel run listens on loopback only: its rendezvous store and its gloo groups
cannot be reached through any other address of this machine."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import subprocess

import pytest
import torch.distributed as dist

from carpool.distributed.comm import loopback_store
from tests.distributed.test_equivalence import TINY


def this_hosts_addresses() -> set[str]:
    """Addresses of this machine other than loopback (and link-local, which needs a scope)."""
    found: set[str] = set()
    try:
        found.update(subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split())
    except (OSError, subprocess.SubprocessError):
        pass
    for host in (socket.gethostname(), socket.getfqdn()):
        try:
            found.update(info[4][0] for info in socket.getaddrinfo(host, None))
        except OSError:
            pass
    try:  # the address of the default route (a UDP "connect" sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            found.add(s.getsockname()[0])
    except OSError:
        pass
    keep = set()
    for a in found:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            keep.add(a)
    return keep


def connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def reachable_addresses() -> list[str]:
    """This machine's non-loopback addresses on which a socket listening everywhere is reachable
    (so a refusal on them means something)."""
    if socket.has_dualstack_ipv6():
        control = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        control = socket.create_server(("", 0))
    with control:
        port = control.getsockname()[1]
        return [a for a in sorted(this_hosts_addresses()) if connects(a, port)]


def test_single_host_store_listens_on_loopback_only():
    addresses = reachable_addresses()
    if not addresses:
        pytest.skip("this machine has no reachable address other than loopback")
    timeout = datetime.timedelta(seconds=10)
    store = loopback_store(2, timeout)
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timeout)
    client.set("carpool/test", "ok")
    assert store.get("carpool/test") == b"ok"
    for address in addresses:
        assert not connects(address, store.port), f"the store is reachable on {address}:{store.port}"
    # torch's own default (what carpool used before) listens everywhere: the check above can fail.
    everywhere = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timeout)
    assert connects(addresses[0], everywhere.port)


def listening(pid: int) -> set[tuple[str, int]]:
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process(pid)
    conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def network_interface() -> str | None:
    """The name of an interface holding one of this machine's reachable non-loopback addresses."""
    psutil = pytest.importorskip("psutil")
    addresses = set(reachable_addresses())
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address.split("%")[0] in addresses for a in addrs)), None)


def test_parallel_engine_listens_on_loopback_only(parallel_engine, tiny_llama, monkeypatch):
    """Store and gloo listeners of the driver and of every worker: all on loopback, even when the
    environment points gloo at a network interface (as a host name resolving to one would)."""
    iface = network_interface()
    if iface is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", iface)
    before = listening(os.getpid())
    engine = parallel_engine(model=tiny_llama, tensor_parallel_size=2, pipeline_parallel_size=2, **TINY)
    sockets = {"driver": listening(os.getpid()) - before}
    sockets.update({f"worker {r}": listening(p.pid) for r, p in engine.executor.processes.items()})
    assert engine.executor.group.store.port in {port for _, port in sockets["driver"]}
    for who, socks in sockets.items():
        assert socks, f"{who} listens on nothing (did psutil see it?)"
        assert all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip, _ in socks), (who, socks)
    assert os.environ.get("GLOO_SOCKET_IFNAME") == iface  # the user's setting is back
