"""A pod's sandbox: what its containers share and outlive, set up before the first starts.

Its network namespace and IP (network.py; hostNetwork pods share the node's), its
/etc/hosts (hosts.py), rewritten in place as Services and pods change, and its own
64 MiB /dev/shm tmpfs. Teardown kills whatever is left in the pod's cgroup, then
removes the netns and unmounts the pod's tmpfs.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import time
from collections.abc import Callable, Collection

from elasticjob_devcluster import cgroups, hosts, network, volumes
from elasticjob_devcluster.kubeapi import Obj
from elasticjob_devcluster.node_context import HOST_IP, NodeContext
from elasticjob_devcluster.pod_runtime import PodRuntime

log = logging.getLogger("elasticjob_devcluster.sandbox")


def free_ip(net: ipaddress.IPv4Network | ipaddress.IPv6Network, used: Collection[str]) -> str:
    """The lowest address of the node's pod CIDR not in use (the first is the gateway's)."""
    for host in list(net.hosts())[1:]:
        if str(host) not in used:
            return str(host)
    raise RuntimeError(f"pod CIDR {net} is full")


def create(
    ctx: NodeContext,
    rt: PodRuntime,
    next_ip: Callable[[], str],
    pods: list[Obj],
    services: list[Obj],
) -> None:
    """The pod's /dev/shm, hosts file and netns with an IP from `next_ip` (hostNetwork
    pods: the node's)."""
    if not rt.spec.get("hostIPC"):  # the runtime's own /dev/shm, shared by the pod
        volumes.mount_tmpfs(rt.shm_dir, volumes.DEFAULT_SHM_BYTES, 0o1777)
    if rt.spec.get("hostNetwork"):
        rt.ip = HOST_IP
        write_hosts(rt, pods, services)
    else:
        rt.ip = next_ip()
        write_hosts(rt, pods, services)
        rt.netns = network.create_pod_netns(ctx.cluster, rt.uid, rt.ip, ctx.service_cidr)
    rt.sandbox = True
    rt.start_time = time.time()
    log.info("pod %s/%s sandbox %s ip %s", rt.namespace, rt.name, rt.netns, rt.ip)


def write_hosts(rt: PodRuntime, pods: list[Obj], services: list[Obj]) -> None:
    """Rewrite the pod's /etc/hosts if its text changed."""
    if rt.torn_down:
        return
    pod = dict(rt.pod)
    pod["status"] = dict(pod.get("status") or {}, podIP=rt.ip)
    text = hosts.hosts_file(pod, pods, services, network.REFUSE_IP)
    if text == rt.hosts_text:
        return
    # in place: the container's /etc/hosts is a bind mount of this very inode
    with open(rt.hosts_path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)
    rt.hosts_text = text


def teardown(ctx: NodeContext, rt: PodRuntime, remove_dir: bool) -> None:
    cgroups.kill(ctx.pod_cgroup(rt.uid))
    if not rt.torn_down:
        if rt.netns:
            network.delete_pod_netns(rt.uid, ctx.cluster)
        rt.torn_down = True
    volumes.unmount_under(rt.dir)  # tmpfs: /dev/shm and emptyDir medium Memory
    if remove_dir:
        shutil.rmtree(rt.dir, ignore_errors=True)
