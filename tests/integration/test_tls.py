"""MQTT over TLS: a test CA, server and client certificates made here with `cryptography`;
paho over TLS, client certificates (CN as user name), and clear logs for protocol mix-ups."""

from __future__ import annotations

import datetime
import ipaddress
import queue
import re
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess, free_port
from tests.mqttbytes import connect_bytes


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    san: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        builder = builder.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("mqlog test CA", ca_key, "mqlog test CA", ca_key, ca=True)
    _write(d / "ca.pem", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "localhost",
        server_key,
        "mqlog test CA",
        ca_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    _write(d / "server.pem", server, server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    _write(d / "client.pem", _issue("device-1", client_key, "mqlog test CA", ca_key), client_key)
    other_key = ec.generate_private_key(ec.SECP256R1())
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    _write(d / "rogue.pem", _issue("device-1", rogue_key, "other CA", other_key), rogue_key)
    return Pki(
        d / "ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "client.pem",
        d / "client.key",
        d / "rogue.pem",
        d / "rogue.key",
    )


def tls_broker(
    factory: BrokerFactory, pki: Pki, *, require: bool = False, config: str = ""
) -> tuple[BrokerProcess, int]:
    port = free_port()
    server = (
        f'tls_port = {port}\ncertfile = "{pki.server_cert}"\n'
        f'keyfile = "{pki.server_key}"\ncafile = "{pki.ca}"\n'
        f"require_certificate = {'true' if require else 'false'}\n"
    )
    broker = factory(server=server, config=config)
    # Ready is the "listening on mqtt://" line; with several workers the supervisor logs the
    # TLS listener on the line after it, which a read right after may not find yet.
    line = f"listening on mqtts://127.0.0.1:{port}"
    deadline = time.monotonic() + 5
    while line not in broker.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert line in broker.log()
    return broker, port


def tls_client(
    port: int,
    pki: Pki,
    client_id: str,
    protocol: int = V311,
    *,
    cert: bool = True,
    rogue: bool = False,
) -> Client:
    c = Client(port, client_id, protocol)
    if rogue:
        c.paho.tls_set(
            ca_certs=str(pki.ca), certfile=str(pki.rogue_cert), keyfile=str(pki.rogue_key)
        )
    elif cert:
        c.paho.tls_set(
            ca_certs=str(pki.ca), certfile=str(pki.client_cert), keyfile=str(pki.client_key)
        )
    else:
        c.paho.tls_set(ca_certs=str(pki.ca))
    return c


def wait_log(broker: BrokerProcess, text: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = broker.log()
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the broker log:\n{broker.log()}")


def test_paho_over_tls_with_client_certificate(broker_factory: BrokerFactory, pki: Pki) -> None:
    broker, port = tls_broker(broker_factory, pki, require=True)
    sub = tls_client(port, pki, "tls-sub", V5)
    assert sub.connect() == 0
    assert sub.subscribe("secure/#", 1) == [1]
    pub = tls_client(port, pki, "tls-pub")
    assert pub.connect() == 0
    for i in range(20):
        pub.publish(f"secure/{i}", b"x" * (i * 1000), qos=1)
    got = sub.expect(20)
    assert [len(m.payload) for m in got] == [i * 1000 for i in range(20)]
    # The plain port still serves, and both listeners share the router.
    plain = Client(broker.port, "plain")
    assert plain.connect() == 0
    plain.publish("secure/plain", "p", qos=1)
    assert sub.expect(1)[0].topic == "secure/plain"
    for c in (sub, pub, plain):
        c.disconnect()


def test_client_certificate_required(broker_factory: BrokerFactory, pki: Pki) -> None:
    broker, port = tls_broker(broker_factory, pki, require=True)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(connect_bytes("nocert"))
                assert s.recv(4) == b"", "a client without certificate must not be served"
        except (ssl.SSLError, ConnectionResetError):
            pass  # TLS 1.3 reports the refusal on the first read, 1.2 in the handshake
    wait_log(broker, "TLS handshake failed")
    # A certificate from another CA: refused in the handshake, never a CONNACK.
    rogue = tls_client(port, pki, "rogue", rogue=True)
    with pytest.raises((queue.Empty, ssl.SSLError, OSError)):
        rogue.connect(timeout=3)
    rogue.paho.loop_stop()
    wait_log(broker, "TLS handshake failed: unable to get local issuer certificate")


def test_certificate_cn_is_the_user_name(
    broker_factory: BrokerFactory, pki: Pki, tmp_path: Path
) -> None:
    acl = tmp_path / "acl"
    acl.write_text("user device-1\ntopic readwrite devices/device-1/#\n")
    broker, port = tls_broker(
        broker_factory,
        pki,
        config=f"[auth]\nallow_anonymous = false\nuse_identity_as_username = true\n"
        f'acl_file = "{acl}"\n',
    )
    dev = tls_client(port, pki, "dev", V5)
    assert dev.connect() == 0, "the certificate is the credential"
    assert dev.subscribe("devices/device-1/#", 1) == [1]
    assert dev.subscribe("devices/device-2/#", 1) == [0x87]
    dev.disconnect()
    nocert = tls_client(port, pki, "nocert", V5, cert=False)
    assert nocert.connect() == 0x87, "no certificate: no identity"
    nocert.disconnect()
    assert Client(broker.port, "plain-anon").connect() == 0x87, "plain port: anonymous"


def test_plain_mqtt_on_the_tls_port_is_logged(broker_factory: BrokerFactory, pki: Pki) -> None:
    broker, port = tls_broker(broker_factory, pki)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(connect_bytes("confused"))
        started = time.monotonic()
        assert s.recv(16) == b""
        assert time.monotonic() - started < 2, "closed at once, not after a timeout"
    log = wait_log(broker, "plain (non-TLS) data (an MQTT CONNECT) on the MQTT over TLS port")
    assert "127.0.0.1:" in log


def test_tls_on_the_plain_port_is_logged(broker_factory: BrokerFactory, pki: Pki) -> None:
    broker, port = tls_broker(broker_factory, pki)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    started = time.monotonic()
    with (
        socket.create_connection(("127.0.0.1", broker.port), timeout=5) as raw,
        pytest.raises((ssl.SSLError, ConnectionResetError)),
    ):
        ctx.wrap_socket(raw, server_hostname="localhost")
    assert time.monotonic() - started < 2
    wait_log(
        broker,
        "TLS handshake (ClientHello) on the plain MQTT port; closing; "
        f"MQTT over TLS is on port {port}",
    )


def test_tls_config_errors_are_clear(
    broker_factory: BrokerFactory, pki: Pki, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.pem"
    broker = broker_factory(
        server=f'tls_port = {free_port()}\ncertfile = "{missing}"\nkeyfile = "{pki.server_key}"\n',
        start=False,
    )
    with pytest.raises(RuntimeError, match=re.escape(f"server.certfile {missing}")):
        broker.start(timeout=10)
    broker2 = broker_factory(server=f"tls_port = {free_port()}\n", start=False)
    required = re.escape("server.certfile and server.keyfile are required")
    with pytest.raises(RuntimeError, match=required):
        broker2.start(timeout=10)
