"""The pod network on its own (root needed): netns per pod, a shared bridge, API forwarding."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest

from elasticjob_devcluster import network

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]


@pytest.fixture
def cluster() -> Iterator[str]:
    name = f"ej-t-{uuid.uuid4().hex[:6]}"
    network.ensure_cluster_network(name)
    network.ensure_cluster_network(name)  # idempotent
    yield name
    assert network.remove_cluster_network(name, force=True)


def serve_once(ns: str, port: int, reply: bytes) -> threading.Thread:
    listener = network.listen_in_netns(ns, "0.0.0.0", port)

    def run() -> None:
        conn, _ = listener.accept()
        conn.sendall(reply)
        conn.close()
        listener.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def connect(ns: str, host: str, port: int) -> bytes:
    s = network.socket_in_netns(ns)
    s.settimeout(5)
    try:
        s.connect((host, port))
        return s.recv(100)
    finally:
        s.close()


def test_pods_on_different_node_cidrs_reach_each_other_on_the_same_port(cluster: str) -> None:
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    try:
        ns_a = network.create_pod_netns(cluster, a, "10.244.1.2")
        ns_b = network.create_pod_netns(cluster, b, "10.244.2.2")
        ns_c = network.create_pod_netns(cluster, c, "10.244.2.3")
        serve_once(ns_a, 8080, b"from a")
        serve_once(ns_b, 8080, b"from b")
        assert connect(ns_c, "10.244.1.2", 8080) == b"from a"
        assert connect(ns_c, "10.244.2.2", 8080) == b"from b"
        with pytest.raises(ConnectionRefusedError):
            connect(ns_c, network.REFUSE_IP, 8080)
        assert network.remove_cluster_network(cluster) is False  # pods still plugged in
    finally:
        for uid in (a, b, c):
            network.delete_pod_netns(uid, cluster)
    assert network.bridge_ports(cluster) == []


def test_cut_network_stops_traffic_and_restore_brings_it_back(cluster: str) -> None:
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        ns_a = network.create_pod_netns(cluster, a, "10.244.1.2")
        ns_b = network.create_pod_netns(cluster, b, "10.244.1.3")
        network.set_pod_network(cluster, a, up=False)
        assert not network.probe_tcp(ns_b, "10.244.1.2", 8080, timeout=1)
        network.set_pod_network(cluster, a, up=True)
        serve_once(ns_a, 8080, b"back")
        assert connect(ns_b, "10.244.1.2", 8080) == b"back"
    finally:
        network.delete_pod_netns(a, cluster)
        network.delete_pod_netns(b, cluster)


def test_restore_routes_the_service_cidr_again(cluster: str) -> None:
    """Taking eth0 down drops its routes: a restored pod must reach clusterIPs again."""
    a = str(uuid.uuid4())
    cidr = "10.96.0.0/16"
    try:
        ns_a = network.create_pod_netns(cluster, a, "10.244.1.2", cidr)
        network.set_pod_network(cluster, a, up=False, service_cidr=cidr)
        gone = subprocess.run(["ip", "-n", ns_a, "route", "get", "10.96.0.10"], check=False)
        assert gone.returncode != 0  # no route while cut
        network.set_pod_network(cluster, a, up=True, service_cidr=cidr)
        route = subprocess.run(
            ["ip", "-n", ns_a, "route", "get", "10.96.0.10"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"via {network.BRIDGE_IP} dev eth0" in route.stdout, route.stdout
    finally:
        network.delete_pod_netns(a, cluster)


def test_cluster_ips_reach_pods_and_the_host_without_taking_pod_ports(cluster: str) -> None:
    """A pod connects to clusterIPs while binding the same ports itself (0.0.0.0)."""
    cidr = "10.96.0.0/16"
    network.route_services(cluster, cidr)
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen()
    host_port = upstream.getsockname()[1]

    def echo() -> None:
        conn, _ = upstream.accept()
        conn.sendall(b"host:" + conn.recv(10))
        conn.close()

    threading.Thread(target=echo, daemon=True).start()
    to_host = network.Proxy(cluster, dial_ns="")
    to_pods = network.Proxy(cluster, dial_ns=cluster)
    try:
        ns_a = network.create_pod_netns(cluster, a, "10.244.1.2", cidr)
        ns_b = network.create_pod_netns(cluster, b, "10.244.1.3", cidr)
        to_host.set_routes({("10.96.0.1", 443): [("127.0.0.1", host_port)]})
        to_pods.set_routes({("10.96.0.7", 80): [("10.244.1.2", 8080)]})
        serve_once(ns_a, 8080, b"pod a")
        busy = network.listen_in_netns(ns_b, "0.0.0.0", 443)  # b's own 443 stays free
        busy.close()
        assert connect(ns_b, "10.96.0.7", 80) == b"pod a"
        s = network.socket_in_netns(ns_b)
        s.settimeout(5)
        s.connect(("10.96.0.1", 443))
        s.sendall(b"ping")
        assert s.recv(100) == b"host:ping"
        s.close()
        with pytest.raises(ConnectionRefusedError):
            connect(ns_b, "10.96.0.8", 80)  # no such service: refused at once
    finally:
        to_host.close()
        to_pods.close()
        upstream.close()
        network.delete_pod_netns(a, cluster)
        network.delete_pod_netns(b, cluster)


def test_a_pod_reusing_an_ip_is_reachable_at_once(cluster: str) -> None:
    """Its MAC follows the IP, so a peer's ARP cache from the previous pod stays valid."""
    old, new, peer = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    try:
        ns_old = network.create_pod_netns(cluster, old, "10.244.1.5")
        ns_peer = network.create_pod_netns(cluster, peer, "10.244.1.6")
        serve_once(ns_old, 8080, b"old")
        assert connect(ns_peer, "10.244.1.5", 8080) == b"old"  # the peer caches the MAC
        network.delete_pod_netns(old, cluster)
        ns_new = network.create_pod_netns(cluster, new, "10.244.1.5")
        serve_once(ns_new, 8080, b"new")
        s = network.socket_in_netns(ns_peer)
        s.settimeout(2)  # a stale ARP entry would cost several seconds here
        s.connect(("10.244.1.5", 8080))
        assert s.recv(10) == b"new"
        s.close()
    finally:
        for uid in (old, new, peer):
            network.delete_pod_netns(uid, cluster)
