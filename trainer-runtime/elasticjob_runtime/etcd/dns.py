"""Which DNS resolver gRPC uses for etcd: the system's, unless the user chose one.

gRPC's default resolver (c-ares) took 2-3 s to open each new connection from a pod to
its job's etcd on kind, where glibc's answered in 2 ms and the TCP connect took less
(measured in a worker pod: ``GRPC_DNS_RESOLVER=native`` brought a new TLS connection from
3.0 s down to 5 ms). Every new client pays it: an agent's start, each lease keeper, each
worker's records. A 1 s lease cannot wait for that, and a keeper that did lost its lease
each time (issue 34). The native resolver asks glibc, as every other program in the pod
does, with the pod's search path and timeouts; we need nothing c-ares adds (gRPC's DNS
service config and SRV load balancing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

GRPC_DNS_RESOLVER: Final = "GRPC_DNS_RESOLVER"  # gRPC's own variable
NATIVE: Final = "native"


def grpc_dns_resolver(env: Mapping[str, str]) -> str:
    """The resolver gRPC is to use: the one ``env`` names (a user's choice stands, even
    ``ares``), else the system's."""
    return env.get(GRPC_DNS_RESOLVER, "").strip() or NATIVE
