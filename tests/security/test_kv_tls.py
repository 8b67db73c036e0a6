"""Optional TLS on the KV gRPC service: certificates made here with
`cryptography` (a self-signed CA, node certificates for 127.0.0.1 signed by it), a real
KVStoreServer and KVStoreClient. TLS clients work; plaintext or wrongly-trusting ones fail."""

from __future__ import annotations

import datetime
import ipaddress

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdcluster.kvstore.client import KVStoreClient
from pdcluster.kvstore.config import KVStoreConfig, KVTLSConfig
from pdcluster.kvstore.errors import KVStoreError, KVTransferError
from pdcluster.engine.core.hashing import block_keys, make_namespace
from tests.kvstore.lru_block_store import lru_server

TOKEN = "tls-test-kv-token"
KEYS = block_keys(list(range(32)), 16, make_namespace("tls-test"))


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pki(directory, name: str) -> dict[str, str]:
    """A CA and a node certificate for 127.0.0.1 signed by it, as PEM files."""
    ca_key, node_key = ec.generate_private_key(ec.SECP256R1()), \
        ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{name}-ca", ca_key, f"{name}-ca", ca_key, ca=True)
    node = _cert(f"{name}-node", node_key, f"{name}-ca", ca_key, ca=False)
    paths = {k: str(directory / f"{name}-{k}.pem") for k in ("ca", "cert", "key")}
    (directory / f"{name}-ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}-cert.pem").write_bytes(node.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}-key.pem").write_bytes(node_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return paths


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    return {"good": _write_pki(directory, "cluster"), "other": _write_pki(directory, "other")}


def _tls(files: dict[str, str], ca: str | None = None) -> KVTLSConfig:
    return KVTLSConfig(cert_file=files["cert"], key_file=files["key"], ca_file=ca)


def _server(tls: KVTLSConfig):
    server = lru_server(KVStoreConfig(token=TOKEN, tls=tls))
    server.start()
    return server


def _roundtrip(client: KVStoreClient) -> None:
    blocks = torch.randn(2, 2, 16, 4)
    client.put_blocks(KEYS, blocks)
    assert torch.equal(client.get_blocks(KEYS), blocks)


@pytest.mark.parametrize("mutual", [False, True])
@pytest.mark.server
def test_tls_client_works_plaintext_and_untrusting_clients_fail(pki, mutual):
    good, other = pki["good"], pki["other"]
    server = _server(_tls(good, good["ca"] if mutual else None))
    try:
        with KVStoreClient(server.address, timeout_s=5.0, token=TOKEN,
                           tls=_tls(good, good["ca"])) as client:
            _roundtrip(client)
        with KVStoreClient(server.address, timeout_s=3.0, token=TOKEN) as plain:
            with pytest.raises(KVTransferError):
                plain.stats()
        # a client that trusts another CA refuses the server's certificate
        with KVStoreClient(server.address, timeout_s=3.0, token=TOKEN,
                           tls=_tls(other, other["ca"])) as wrong_ca:
            with pytest.raises(KVTransferError):
                wrong_ca.stats()
    finally:
        server.stop(grace=0)


@pytest.mark.server
def test_mutual_tls_refuses_a_client_certificate_from_another_ca(pki):
    good, other = pki["good"], pki["other"]
    server = _server(_tls(good, good["ca"]))
    try:
        # trusts the server, but presents a certificate the server's CA did not sign
        stranger = KVTLSConfig(cert_file=other["cert"], key_file=other["key"],
                               ca_file=good["ca"])
        with KVStoreClient(server.address, timeout_s=3.0, token=TOKEN, tls=stranger) as c:
            with pytest.raises(KVTransferError):
                c.stats()
        assert server.store.stats()["num_blocks"] == 0
    finally:
        server.stop(grace=0)


@pytest.mark.server
def test_unreadable_files_are_a_clear_error(tmp_path, pki):
    missing = KVTLSConfig(cert_file=str(tmp_path / "nope.pem"), key_file=pki["good"]["key"])
    with pytest.raises(KVStoreError, match="nope.pem"):
        lru_server(KVStoreConfig(tls=missing)).start()
    with pytest.raises(KVStoreError, match="nope.pem"):
        KVStoreClient("127.0.0.1:1", tls=missing)


def test_tls_config_needs_both_cert_and_key():
    with pytest.raises(ValueError):
        KVTLSConfig(cert_file="c.pem")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.server
def test_a_cluster_serves_over_mutual_tls_kv_plane(pki):
    """Every KV client in the cluster (prefill, decode, remote stores) gets the TLS settings:
    a request crosses the KV gRPC plane (tail block prefill → decode) and completes."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from pdcluster.deploy.config import ServeConfig
    from pdcluster.deploy.launcher import Cluster
    from pdcluster.deploy.serve import gateway_app
    from tests.background_server import BackgroundServer

    good = pki["good"]
    config = ServeConfig(pd_decider="always",
                         ray_num_cpus=4, actor_num_cpus=0.1, ray_namespace="pdcluster-tls",
                         kvstore=KVStoreConfig(tls=_tls(good, good["ca"])))
    with Cluster(config) as cluster:
        with BackgroundServer(gateway_app(cluster.config, cluster)) as server:
            prompt = list(range(3, 3 + 40))  # 2 full blocks + a tail
            body = {"model": "stories260K", "prompt": prompt, "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
    fetched = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "pdcluster_kv_transfer_bytes_total")
    assert fetched > 0  # the decode worker received KV through the TLS store
