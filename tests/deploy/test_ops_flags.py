"""The issue-9 flags reach ServeConfig: in-flight bound, log format, drain timeout, KV TLS."""

from __future__ import annotations

import pytest

from pdcluster.deploy.cli import _overrides, _parser
from pdcluster.deploy.config import load_config


def _config(*flags: str):
    return load_config(None, _overrides(_parser().parse_args(["serve", *flags])))


def test_defaults_bound_inflight_requests_and_log_text():
    config = _config()
    assert config.max_inflight_requests == 256 and config.log_format == "text"
    assert config.drain_timeout_s == 30 and config.kvstore.tls is None


def test_flags_set_the_bound_the_format_the_drain_and_tls():
    config = _config("--max-inflight-requests", "7", "--log-format", "json",
                     "--drain-timeout", "2.5", "--kv-tls-cert", "c.pem", "--kv-tls-key",
                     "k.pem", "--kv-tls-ca", "ca.pem")
    assert (config.max_inflight_requests, config.log_format, config.drain_timeout_s) == \
        (7, "json", 2.5)
    tls = config.kvstore.tls
    assert (tls.cert_file, tls.key_file, tls.ca_file) == ("c.pem", "k.pem", "ca.pem")


@pytest.mark.parametrize("flags", [("--max-inflight-requests", "0"), ("--log-format", "xml"),
                                   ("--kv-tls-ca", "ca.pem"), ("--kv-tls-cert", "c.pem")])
def test_invalid_values_are_refused(flags):
    with pytest.raises(ValueError):
        _config(*flags)
