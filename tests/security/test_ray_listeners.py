"""The local Ray that `pdcluster serve` starts listens on loopback only: no process of the
cluster (GCS, raylet, agents, autoscaler monitor, every core worker, the gateway) has a TCP
listener or a bound UDP socket on 0.0.0.0, ::, or any address but loopback
(deploy/local_ray.py)."""

from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest

pytestmark = pytest.mark.slow


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # a dual-stack socket bound to ::ffff:127.0.0.1
    return addr.is_loopback


def listeners(procs: list[psutil.Process]) -> list[tuple[str, int, str, int]]:
    """(process name, pid, ip, port) of every TCP listener and bound UDP socket."""
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            bound_udp = c.type == socket.SOCK_DGRAM and c.laddr and not c.raddr
            if c.status == psutil.CONN_LISTEN or bound_udp:
                out.append((name, p.pid, c.laddr.ip, c.laddr.port))
    return out


def test_every_listener_of_the_local_cluster_is_loopback(serve):
    served = serve()
    procs = [psutil.Process(served.proc.pid), *served.tree]
    found = listeners(procs)
    names = {name for name, *_ in found}
    # not vacuous: the gateway, GCS, raylet and the workers' core-worker servers were seen
    assert {"pdcluster", "gcs_server", "raylet"} <= names, found
    assert any(n.startswith("ray::KVStore") for n in names), found
    exposed = [entry for entry in found if not is_loopback(entry[2])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_mooncake_transfer_engine_listens_on_loopback_only(serve):
    """Mooncake's Transfer Engine binds every interface by itself; with `--kv-transfer
    mooncake` both workers' TE listeners (handshake and TCP transport; the decode's start with
    its first read) are on the transfer bind address, 127.0.0.1, like the rest."""
    from tests.real_parts import MOONCAKE_HINT, import_real_part

    import_real_part("mooncake.engine", "Mooncake's Transfer Engine", MOONCAKE_HINT)
    import httpx

    served = serve("--kv-transfer", "mooncake", "--pd-decider", "always")
    before = {port for *_, port in listeners([psutil.Process(served.proc.pid),
                                              *served.tree])}
    r = httpx.post(f"http://127.0.0.1:{served.port}/v1/completions", timeout=60,
                   json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4})
    assert r.status_code == 200, r.text
    found = listeners([psutil.Process(served.proc.pid), *served.record_tree()])
    te = [entry for entry in found if entry[3] not in before]
    assert len(te) >= 2, found  # not vacuous: at least the decode's two TE listeners are new
    exposed = [entry for entry in found if not is_loopback(entry[2])]
    assert not exposed, f"listening beyond loopback: {exposed}"
