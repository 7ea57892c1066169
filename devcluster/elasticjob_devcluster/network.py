"""The devcluster's pod network: a bridge in its own netns and one netns per pod.

Layout: netns `<cluster>` (e.g. ej-net) holds bridge `ej-br` with address REFUSE_IP;
pod netns `ej-<uid12>` holds `eth0` (pod IP, prefix /16 so pods of every node's /24 are
on-link) whose veth peer `v<uid12>` is a port of the bridge. Nothing is added to the root
netns, so the host's own network never changes. The agent reaches into a pod netns from
a helper thread that calls setns(2): sockets keep the netns they were created in, which
is how the agent listens on a pod's loopback (API server forwarding) and probes pods.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

CLUSTER_CIDR = "10.244.0.0/16"
CLUSTER_PREFIX = 16
REFUSE_IP = "10.244.255.254"
BRIDGE = "ej-br"
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
            _ip("-n", name, "link", "add", BRIDGE, "type", "bridge")
        addrs = _ip("-n", name, "-o", "addr", "show", "dev", BRIDGE).stdout
        if f"{REFUSE_IP}/" not in addrs:
            _ip("-n", name, "addr", "add", f"{REFUSE_IP}/{CLUSTER_PREFIX}", "dev", BRIDGE)
        _ip("-n", name, "link", "set", BRIDGE, "up")


def bridge_ports(name: str) -> list[str]:
    """The pod veths still plugged into the cluster bridge."""
    if not netns_exists(name):
        return []
    out = _ip("-n", name, "-o", "link", "show", "master", BRIDGE, check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


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


def create_pod_netns(cluster: str, uid: str, ip: str) -> str:
    """A fresh netns for a pod, wired to the bridge with `ip`; returns its name."""
    ns, veth = pod_netns_name(uid), host_veth_name(uid)
    delete_pod_netns(uid, cluster)
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", veth, "netns", cluster)
        _ip("-n", ns, "addr", "add", f"{ip}/{CLUSTER_PREFIX}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", cluster, "link", "set", veth, "master", BRIDGE)
        _ip("-n", cluster, "link", "set", veth, "up")
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


def set_pod_network(cluster: str, uid: str, up: bool) -> None:
    """Cut (both veth ends down) or restore a pod's network."""
    state = "up" if up else "down"
    _ip("-n", pod_netns_name(uid), "link", "set", "eth0", state)
    _ip("-n", cluster, "link", "set", host_veth_name(uid), state)


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


def listen_in_netns(ns: str, host: str, port: int) -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(64)
        return s

    return in_netns(ns, make)


def socket_in_netns(ns: str) -> socket.socket:
    """An unconnected TCP socket that lives in netns `ns` (connect it from any thread)."""
    return in_netns(ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class PodForwarder:
    """Forwards connections to a pod's 127.0.0.1:<ports> to the API server on host loopback.

    A pod netns cannot reach the host's loopback, so the agent listens inside it. TLS goes
    end to end; the agent only copies bytes. Cutting the pod's network also closes these.
    """

    def __init__(self, ns: str, ports: list[int], target: tuple[str, int]) -> None:
        self.ns = ns
        self.target = target
        self.cut = False
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listeners = [listen_in_netns(ns, "127.0.0.1", p) for p in ports]
        for ls in self._listeners:
            ls.settimeout(0.5)
            threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        try:
            up = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return
        up.settimeout(None)
        with self._lock:
            self._conns.update((conn, up))
        t = threading.Thread(target=_pipe, args=(up, conn), daemon=True)
        t.start()
        _pipe(conn, up)
        t.join()
        with self._lock:
            self._conns.difference_update((conn, up))
        conn.close()
        up.close()

    def set_cut(self, cut: bool) -> None:
        self.cut = cut
        if cut:
            self._close_conns()

    def _close_conns(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        for ls in self._listeners:
            with contextlib.suppress(OSError):
                ls.close()
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
