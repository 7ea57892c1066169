"""The one parser of etcd endpoints, as `--rdzv-endpoint` and the operator give them."""

from __future__ import annotations

import re

import pytest

from elasticjob_runtime.etcd.endpoints import Endpoint, parse_endpoints


def test_every_member_of_a_comma_separated_list_is_kept() -> None:
    assert parse_endpoints("etcd-0:2379, etcd-1:2380,,etcd-2") == [
        Endpoint("etcd-0", 2379),
        Endpoint("etcd-1", 2380),
        Endpoint("etcd-2", 2379),
    ]


def test_scheme_brackets_and_trailing_slash_are_tolerated() -> None:
    assert parse_endpoints("http://10.0.0.5:2379/") == [Endpoint("10.0.0.5", 2379)]
    assert parse_endpoints("https://[::1]:2379") == [Endpoint("::1", 2379)]
    assert parse_endpoints(":2379") == [Endpoint("127.0.0.1", 2379)]
    assert parse_endpoints("etcd", default_port=4001) == [Endpoint("etcd", 4001)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the etcd endpoint is empty; pass host:port"),
        (" , ", "the etcd endpoint is empty; pass host:port"),
        ("etcd:http", "bad etcd endpoint 'etcd:http': the port must be a number from 1 to 65535"),
        ("etcd:0", "bad etcd endpoint 'etcd:0': the port must be a number"),
        ("a:2379,http://", "bad etcd endpoint 'http://': no host"),
    ],
)
def test_bad_endpoints_say_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_endpoints(text)
