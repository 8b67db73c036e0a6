"""gRPC credentials of the KV plane from a :class:`kvstore.config.KVTLSConfig` (optional TLS on
the KV gRPC service)."""

from __future__ import annotations

from pathlib import Path

import grpc

from pdcluster.kvstore.config import KVTLSConfig
from pdcluster.kvstore.errors import KVStoreError


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise KVStoreError(f"cannot read the KV TLS {what} {path}: {exc}") from exc


def server_credentials(tls: KVTLSConfig) -> grpc.ServerCredentials:
    """The server's certificate; with ``ca_file``, client certificates signed by that CA are
    required (mutual TLS). Raises KVStoreError when a file cannot be read."""
    ca = _read(tls.ca_file, "CA bundle")
    pair = (_read(tls.key_file, "key"), _read(tls.cert_file, "certificate"))
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(tls: KVTLSConfig) -> grpc.ChannelCredentials:
    """Verify the server against ``ca_file`` (else the system's roots) and present this node's
    certificate when asked. Raises KVStoreError when a file cannot be read."""
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "CA bundle"),
                                        private_key=_read(tls.key_file, "key"),
                                        certificate_chain=_read(tls.cert_file, "certificate"))


def channel_options(tls: KVTLSConfig | None) -> list[tuple[str, str]]:
    """Extra channel options: the name checked in the server's certificate, when set."""
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]
