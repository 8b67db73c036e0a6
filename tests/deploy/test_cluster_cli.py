"""A gateway attached to a running cluster takes the cluster's settings from its record and
only its own from its flags (deploy/cluster_cli.py); the record round-trips through Ray's
plain data (deploy/cluster_record.py). The processes themselves: tests/chaos/test_gateway_death.py."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from pdcluster.deploy.cluster_cli import GATEWAY_FIELDS, gateway_config
from pdcluster.deploy.cluster_record import ClusterManifest
from pdcluster.deploy.config import ServeConfig
from pdcluster.kvstore.config import KVStoreConfig


def cluster_json() -> str:
    return ServeConfig(prefill_instances=2, decode_instances=3, pd_decider="always",
                       kvstore=KVStoreConfig(token=SecretStr("s3cret")),
                       api_keys=[SecretStr("key")]).model_dump_json()


def test_a_gateway_keeps_the_cluster_s_settings_and_sets_its_own():
    config = gateway_config(cluster_json(), {"port": 8123, "max_inflight_requests": 8})
    assert (config.prefill_instances, config.decode_instances, config.pd_decider) == \
        (2, 3, "always")
    assert (config.port, config.max_inflight_requests) == (8123, 8)
    # the record masks secrets: neither a KV token nor API keys come from it
    assert config.kvstore.token is None and config.api_keys == []
    assert "s3cret" not in cluster_json()


@pytest.mark.parametrize("field", ["prefill_instances", "engine", "transfer", "colocated"])
def test_a_cluster_setting_given_to_a_gateway_is_refused(field):
    assert field not in GATEWAY_FIELDS
    with pytest.raises(ValueError, match=f"{field}: the cluster's settings"):
        gateway_config(cluster_json(), {field: 1})


def test_the_manifest_round_trips_as_plain_data():
    manifest = ClusterManifest(cluster_json(), ("prefill-0",), ("decode-0", "decode-1"),
                               {"ab" * 28: "pdcluster-kvstore-" + "ab" * 28}, "pdcluster-kv-index",
                               ("pg-decode-0",), "127.0.0.1:6379")
    assert ClusterManifest.from_dict(manifest.to_dict()) == manifest


@pytest.mark.parametrize("watch", ["0", "-1", "x", "nan"])
def test_status_watch_takes_only_a_positive_interval(watch, capsys):
    from pdcluster.deploy.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "status", "--watch", watch])
    assert exit_.value.code == 2  # argparse's usage error, before any Ray is joined
    assert "not a positive number of seconds" in capsys.readouterr().err
