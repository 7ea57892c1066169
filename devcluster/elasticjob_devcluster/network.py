"""The devcluster's pod network: a bridge in its own netns and one netns per pod.

Layout: netns `<cluster>` (e.g. ej-net-1a2b3c4d) holds bridge `ej-br` with address
BRIDGE_IP; pod netns `ej-<uid12>` holds `eth0` (pod IP, prefix /16 so pods of every
node's /24 are on-link) whose veth peer `v<uid12>` is a port of the bridge. Each pod
routes the service CIDR to BRIDGE_IP, and the cluster netns treats the whole service
CIDR as local, so connections to any clusterIP land in the cluster netns, where the
node agents' Proxy listens (SO_REUSEPORT: every agent may listen on the same clusterIP,
the kernel spreads connections). Nothing listens inside a pod's own netns, so a pod may
bind any port. Nothing is added to the root netns. The agent reaches into a netns from a
helper thread that calls setns(2): sockets keep the netns they were created in.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

CLUSTER_CIDR = "10.244.0.0/16"
CLUSTER_PREFIX = 16
BRIDGE_IP = "10.244.255.254"
REFUSE_IP = BRIDGE_IP  # nothing listens there: connecting is refused at once
BRIDGE = "ej-br"
BRIDGE_MAC = "02:65:6a:00:00:01"  # locally administered, fixed for the bridge's lifetime
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000

T = TypeVar("T")


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    path = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
    with open(path / f"elasticjob-netns-{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_cluster_network(name: str) -> None:
    """Create the cluster netns and its bridge unless they exist (safe to call concurrently)."""
    with _lock(name):
        if not netns_exists(name):
            _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        if _ip("-n", name, "link", "show", BRIDGE, check=False).returncode != 0:
            # A fixed address: by default a bridge takes its lowest port's MAC, so deleting
            # that pod changed the gateway's MAC under every pod's ARP cache and cut their
            # clusterIP traffic for up to a minute (seen as etcd timeouts after a deletion).
            _ip("-n", name, "link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge")
        addrs = _ip("-n", name, "-o", "addr", "show", "dev", BRIDGE).stdout
        if f"{BRIDGE_IP}/" not in addrs:
            _ip("-n", name, "addr", "add", f"{BRIDGE_IP}/{CLUSTER_PREFIX}", "dev", BRIDGE)
        _ip("-n", name, "link", "set", BRIDGE, "up")


def bridge_ports(name: str) -> list[str]:
    """The pod veths still plugged into the cluster bridge."""
    if not netns_exists(name):
        return []
    out = _ip("-n", name, "-o", "link", "show", "master", BRIDGE, check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def route_services(cluster: str, service_cidr: str) -> None:
    """Make every clusterIP a local address of the cluster netns (idempotent)."""
    _ip("-n", cluster, "route", "replace", "local", service_cidr, "dev", "lo")


def remove_cluster_network(name: str, force: bool = False) -> bool:
    """Delete the cluster netns unless pods (of another cluster sharing the name) are still
    plugged in; force=True deletes it anyway. Returns whether it is gone."""
    with _lock(name):
        if not netns_exists(name):
            return True
        deadline = time.monotonic() + 3
        while bridge_ports(name) and not force:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)  # veths of just-deleted pod netns go away asynchronously
        _ip("netns", "del", name)
        return True


def pod_netns_name(uid: str) -> str:
    return "ej-" + uid.replace("-", "")[:12]


def host_veth_name(uid: str) -> str:
    return "v" + uid.replace("-", "")[:12]


def mac_for_ip(ip: str) -> str:
    """A locally administered MAC derived from an IPv4 address: 02:42:a:b:c:d."""
    return "02:42:" + ":".join(f"{int(octet):02x}" for octet in ip.split("."))


def create_pod_netns(cluster: str, uid: str, ip: str, service_cidr: str = "") -> str:
    """A fresh netns for a pod, wired to the bridge with `ip`; returns its name. The
    service CIDR, if given, is routed through the bridge to the cluster netns, where the
    agents' service proxy listens on clusterIPs."""
    ns, veth = pod_netns_name(uid), host_veth_name(uid)
    delete_pod_netns(uid, cluster)
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "set", "lo", "up")
        # the MAC follows the IP (as Docker does): a pod that reuses a deleted pod's IP
        # keeps its MAC, so peers' ARP caches stay right instead of blackholing it a while
        mac = mac_for_ip(ip)
        peer = ["peer", "name", veth, "netns", cluster]
        _ip("-n", ns, "link", "add", "eth0", "address", mac, "type", "veth", *peer)
        _ip("-n", ns, "addr", "add", f"{ip}/{CLUSTER_PREFIX}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", cluster, "link", "set", veth, "master", BRIDGE)
        _ip("-n", cluster, "link", "set", veth, "up")
        if service_cidr:
            _ip("-n", ns, "route", "add", service_cidr, "via", BRIDGE_IP, "dev", "eth0")
    except NetworkError:
        delete_pod_netns(uid, cluster)
        raise
    return ns


def delete_pod_netns(uid: str, cluster: str = "") -> None:
    """Remove a pod's netns; with `cluster`, unplug its veth at once (a deleted netns
    releases its devices asynchronously, which would leave a bridge port for a while)."""
    if cluster and netns_exists(cluster):
        _ip("-n", cluster, "link", "del", host_veth_name(uid), check=False)
    ns = pod_netns_name(uid)
    if netns_exists(ns):
        _ip("netns", "del", ns, check=False)


def delete_node_pods_netns(node_state_dir: Path, cluster: str) -> list[str]:
    """Remove the netns of every pod a node agent ran (its `pods/<uid>` dirs): what
    `down` calls after an agent that could not clean up (SIGKILLed, lost)."""
    removed = []
    pods = node_state_dir / "pods"
    for d in sorted(pods.iterdir()) if pods.is_dir() else []:
        if netns_exists(pod_netns_name(d.name)):
            delete_pod_netns(d.name, cluster)
            removed.append(pod_netns_name(d.name))
    return removed


def set_pod_network(cluster: str, uid: str, up: bool, service_cidr: str = "") -> None:
    """Cut (both veth ends down) or restore a pod's network. The kernel drops a link's
    routes when it goes down, so a restore routes the service CIDR again (without it the
    pod would reach pods but never a clusterIP: its etcd, the API server)."""
    ns, state = pod_netns_name(uid), "up" if up else "down"
    _ip("-n", ns, "link", "set", "eth0", state)
    _ip("-n", cluster, "link", "set", host_veth_name(uid), state)
    if up and service_cidr:
        _ip("-n", ns, "route", "replace", service_cidr, "via", BRIDGE_IP, "dev", "eth0")


def list_pod_netns() -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith("ej-"))


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run fn in a short-lived thread that has joined netns `ns` (the caller's stays put)."""
    if not ns:  # a hostNetwork pod: the agent's own network
        return fn()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
            try:
                _setns(fd, CLONE_NEWNET)
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:
            error.append(e)

    # The thread ends after fn, so it never runs anything else in the pod's netns.
    t = threading.Thread(target=run, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def listen_in_netns(ns: str, host: str, port: int, reuse_port: bool = False) -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        s.listen(64)
        return s

    return in_netns(ns, make)


def socket_in_netns(ns: str) -> socket.socket:
    """An unconnected TCP socket that lives in netns `ns` (connect it from any thread)."""
    return in_netns(ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s sending side: one
    direction of a relayed connection."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


Route = tuple[str, int]


class Proxy:
    """Listens on addresses in netns `ns` and relays each connection to one of the
    targets routed for it (tried in random order, as kube-proxy spreads load).

    `dial_ns` is the netns the relay dials from: the cluster netns reaches pod IPs on
    the bridge; "" dials from the agent's own netns (host loopback, where the API
    server listens). Bytes are copied as they are: TLS goes end to end.
    """

    def __init__(self, ns: str, dial_ns: str) -> None:
        self.ns = ns
        self.dial_ns = dial_ns
        self._lock = threading.Lock()
        self._listeners: dict[Route, socket.socket] = {}
        self._routes: dict[Route, list[Route]] = {}
        self._conns: set[socket.socket] = set()

    def set_routes(self, routes: dict[Route, list[Route]]) -> None:
        """Listen on exactly the routed addresses and send new connections to the targets."""
        with self._lock:
            self._routes = {k: list(v) for k, v in routes.items()}
            gone = [k for k in self._listeners if k not in routes]
            new = [k for k in routes if k not in self._listeners]
        for key in gone:
            with self._lock:
                ls = self._listeners.pop(key)
            with contextlib.suppress(OSError):
                ls.close()
        for key in new:
            try:
                ls = listen_in_netns(self.ns, key[0], key[1], reuse_port=True)
            except OSError:
                continue  # e.g. an address outside the routed service CIDR
            ls.settimeout(0.5)
            with self._lock:
                self._listeners[key] = ls
            threading.Thread(target=self._accept, args=(key, ls), daemon=True).start()

    def _accept(self, key: Route, ls: socket.socket) -> None:
        while True:
            with self._lock:
                if self._listeners.get(key) is not ls:
                    return
            try:
                conn, _ = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(key, conn), daemon=True).start()

    def _dial(self, target: Route) -> socket.socket:
        if self.dial_ns:
            s = socket_in_netns(self.dial_ns)
            s.settimeout(5)
            try:
                s.connect(target)
            except OSError:
                s.close()
                raise
            return s
        return socket.create_connection(target, timeout=5)

    def _serve(self, key: Route, conn: socket.socket) -> None:
        with self._lock:
            targets = list(self._routes.get(key, []))
        random.shuffle(targets)
        up: socket.socket | None = None
        for target in targets:
            try:
                up = self._dial(target)
                break
            except OSError:
                continue
        if up is None:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # a reset, as from a backend that is gone
            return
        conn.settimeout(None)
        up.settimeout(None)
        with self._lock:
            self._conns.update((conn, up))
        t = threading.Thread(target=pipe, args=(up, conn), daemon=True)
        t.start()
        pipe(conn, up)
        t.join()
        with self._lock:
            self._conns.difference_update((conn, up))
        conn.close()
        up.close()

    def _close_conns(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.set_routes({})
        self._close_conns()


def probe_tcp(ns: str, host: str, port: int, timeout: float) -> bool:
    """A tcpSocket probe from inside the pod's netns."""
    s = socket_in_netns(ns)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def probe_http(ns: str, host: str, port: int, path: str, timeout: float) -> bool:
    """An httpGet probe (plain HTTP) from inside the pod's netns: 200-399 passes."""
    s = socket_in_netns(ns)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        req = f"GET {path or '/'} HTTP/1.0\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe\r\n\r\n"
        s.sendall(req.encode())
        head = s.recv(64).split(b" ", 2)
        return len(head) >= 2 and head[1].isdigit() and 200 <= int(head[1]) < 400
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ECONNRESET) or isinstance(e, TimeoutError):
            return False
        return False
    finally:
        s.close()
