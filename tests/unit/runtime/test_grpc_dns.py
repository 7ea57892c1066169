"""gRPC resolves etcd's name with the system's resolver unless the user chose another."""

from __future__ import annotations

import os
import subprocess
import sys

from elasticjob_runtime.etcd.dns import GRPC_DNS_RESOLVER, grpc_dns_resolver


def test_the_system_resolver_unless_the_user_named_one() -> None:
    assert grpc_dns_resolver({}) == "native"
    assert grpc_dns_resolver({GRPC_DNS_RESOLVER: " "}) == "native"
    assert grpc_dns_resolver({GRPC_DNS_RESOLVER: "ares"}) == "ares"


def test_importing_the_client_sets_it_before_grpc_starts() -> None:
    """In a fresh interpreter, as an agent or a worker starts: the variable is set by the
    time gRPC is imported (gRPC reads it once)."""
    code = (
        "import os, sys\n"
        "import elasticjob_runtime.etcd.client\n"
        "print(os.environ['GRPC_DNS_RESOLVER'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != GRPC_DNS_RESOLVER}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "native"
    env[GRPC_DNS_RESOLVER] = "ares"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ares"
