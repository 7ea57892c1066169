"""Which TLS an etcd connection uses: the endpoint's scheme, torch's rdzv_conf keys and
the ELASTICJOB_ETCD_* variables, and the one-line errors when they are wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdError, connection_hint, tls_problem
from elasticjob_runtime.etcd.endpoints import TLSCredentials
from elasticjob_runtime.etcd.tls import (
    EtcdTLS,
    credentials,
    parse_conf,
    tls_environ,
    tls_settings,
)

ENV = {
    contract.ETCD_CACERT: "/tls/ca.crt",
    contract.ETCD_CERT: "/tls/tls.crt",
    contract.ETCD_KEY: "/tls/tls.key",
}


def test_plain_text_unless_something_asks_for_tls() -> None:
    assert tls_settings("etcd:2379", {}, {}) is None
    assert tls_settings("http://etcd:2379", {"protocol": "http"}, {}) is None


def test_https_without_files_verifies_etcd_with_the_system_roots() -> None:
    assert tls_settings("https://etcd:2379", {}, {}) == EtcdTLS()
    assert tls_settings("etcd:2379", {"protocol": "https"}, {}) == EtcdTLS()


def test_the_operators_variables_turn_tls_on() -> None:
    tls = tls_settings("etcd:2379", {}, ENV)
    assert tls == EtcdTLS("/tls/ca.crt", "/tls/tls.crt", "/tls/tls.key")


def test_torchs_rdzv_conf_keys_win_over_the_variables() -> None:
    conf = parse_conf("join_timeout=60,cacert=/mine/ca.pem,cert=/mine/c.pem,key=/mine/k.pem")
    tls = tls_settings("https://etcd:2379", conf, ENV)
    assert tls is not None
    assert (tls.cacert, tls.cert, tls.key) == ("/mine/ca.pem", "/mine/c.pem", "/mine/k.pem")
    assert tls.cert_from == "--rdzv-conf cert"
    only_ca = tls_settings("https://etcd:2379", {"cacert": "/mine/ca.pem"}, {})
    assert only_ca == EtcdTLS(cacert="/mine/ca.pem", cacert_from="--rdzv-conf cacert")


@pytest.mark.parametrize(
    ("endpoint", "conf", "env", "message"),
    [
        (
            "http://etcd:2379",
            {},
            ENV,
            "ELASTICJOB_ETCD_CACERT is set but the etcd endpoint 'http://etcd:2379' is plain "
            "http; use an https:// endpoint, or unset ELASTICJOB_ETCD_CACERT",
        ),
        (
            "https://etcd:2379",
            {"protocol": "http"},
            {},
            "--rdzv-conf protocol=http contradicts the endpoint 'https://etcd:2379'",
        ),
        ("etcd:2379", {"protocol": "tls"}, {}, "--rdzv-conf protocol=tls: must be http or https"),
        (
            "https://a:2379,http://b:2379",
            {},
            {},
            "etcd endpoint 'https://a:2379,http://b:2379' mixes http:// and https://",
        ),
        (
            "etcd:2379",
            {"cert": "/c.pem"},
            {},
            "--rdzv-conf cert is set but ELASTICJOB_ETCD_KEY is not; a client certificate "
            "needs both",
        ),
    ],
)
def test_contradictions_are_one_line_naming_the_setting(
    endpoint: str, conf: dict[str, str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        tls_settings(endpoint, conf, env)


def test_the_launcher_hands_the_files_to_its_workers_as_variables() -> None:
    tls = tls_settings("etcd:2379", {"cacert": "/c/ca", "cert": "/c/crt", "key": "/c/key"}, {})
    assert tls_environ(tls) == {
        contract.ETCD_CACERT: "/c/ca",
        contract.ETCD_CERT: "/c/crt",
        contract.ETCD_KEY: "/c/key",
    }
    assert tls_environ(None) == {}


def test_a_missing_or_non_pem_file_names_the_file_and_the_setting(tmp_path: Path) -> None:
    missing = EtcdTLS(cacert=str(tmp_path / "nope.crt"))
    with pytest.raises(
        EtcdError,
        match=r"cannot read the etcd CA certificate .*nope\.crt "
        r"\(ELASTICJOB_ETCD_CACERT\): No such file",
    ):
        credentials(missing)
    key = tmp_path / "tls.key"
    key.write_text("-----BEGIN CERTIFICATE-----\nnot a key\n")
    crt = tmp_path / "tls.crt"
    crt.write_text("-----BEGIN CERTIFICATE-----\nsecret-ish\n")
    with pytest.raises(EtcdError) as info:
        credentials(EtcdTLS(cert=str(crt), key=str(key), key_from="--rdzv-conf key"))
    assert str(info.value) == f"the etcd client key {key} (--rdzv-conf key) is not in PEM format"
    assert "not a key" not in str(info.value)  # never the content


def test_handshake_failures_say_which_side_refused_and_what_to_check() -> None:
    creds = TLSCredentials(
        ca=b"x",
        cert=b"y",
        key=b"z",
        ca_from="ELASTICJOB_ETCD_CACERT=/t/ca.crt",
        cert_from="ELASTICJOB_ETCD_CERT=/t/tls.crt",
    )
    verify = "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED"
    refused = "Tls handshake failed: SSL_ERROR_SSL: SSLV3_ALERT_BAD_CERTIFICATE: OK"
    assert "not signed by a CA in ELASTICJOB_ETCD_CACERT=/t/ca.crt" in str(
        tls_problem(verify, creds)
    )
    assert "etcd refused the client certificate; check that ELASTICJOB_ETCD_CERT=/t/tls.crt" in (
        str(tls_problem(refused, creds))
    )
    # TLS 1.3: etcd's alert after the client's handshake reaches gRPC as data it cannot read
    late = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.96.0.5:2379: "
    late += "Unwrap failed (TSI_DATA_CORRUPTED)"
    assert "etcd refused the client certificate" in str(tls_problem(late, creds))
    no_cert = TLSCredentials(ca=b"x")
    assert "etcd asks for a client certificate and none was given" in str(
        tls_problem(refused, no_cert)
    )
    assert tls_problem("Connection refused", creds) is None  # etcd down: not a TLS problem
    # gRPC's TCP connect timing out (seen on kind: a new pod's SYNs dropped until
    # NetworkPolicy admits it) is no TLS verdict: the launcher waits for etcd instead
    no_syn_ack = "failed to connect to all addresses; last error: UNKNOWN: "
    assert tls_problem(no_syn_ack + "ipv4:10.96.48.18:2379: tcp handshaker shutdown", creds) is None
    assert tls_problem(refused, None) is None


def test_a_closed_connection_is_a_hint_at_the_settings_not_a_verdict() -> None:
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:2379: "
    plain = connection_hint(closed + "Socket closed", None)
    assert plain.startswith("; if etcd serves TLS, use an https:// endpoint")
    no_cert = connection_hint(closed + "Connection reset by peer", TLSCredentials(ca=b"x"))
    assert "if it asks for a client certificate (a job's own etcd does), set " in no_cert
    theirs = TLSCredentials(ca=b"x", cert=b"y", key=b"z", cert_from="--rdzv-conf cert=/o/t.crt")
    assert "check that --rdzv-conf cert=/o/t.crt is signed by the CA etcd trusts" in (
        connection_hint(closed + "Socket closed", theirs)
    )
    assert connection_hint(closed + "Connection refused", theirs) == ""  # etcd is down
