"""The cluster record's membership changes and scaler lease (deploy.cluster_record), on the
record class itself: what gateways of one cluster agree on."""

from __future__ import annotations

import time

from pdcluster.deploy.cluster_record import ClusterManifest, ClusterRecord


def record() -> ClusterRecord:
    return ClusterRecord(ClusterManifest("{}", ("prefill-0",), ("decode-0",), {}).to_dict(),
                         '{"kvstore": {"token": "t"}}')


def test_one_gateway_holds_the_lease_until_it_lapses():
    r = record()
    assert r.scaler_lease("a", 0.2) and r.scaler_lease("a", 0.2)  # renewed
    assert not r.scaler_lease("b", 0.2)
    time.sleep(0.25)
    assert r.scaler_lease("b", 0.2) and not r.scaler_lease("a", 0.2)


def test_membership_changes_bump_the_version_and_read_back():
    r = record()
    r.add_worker("prefill", "prefill-1", "pg-prefill-1")
    r.drain_worker("prefill-0")
    m = ClusterManifest.from_dict(r.manifest())
    assert m.prefill == ("prefill-0", "prefill-1") and m.draining == ("prefill-0",)
    assert m.placement_groups == ("pg-prefill-1",) and m.version == 2
    r.remove_worker("prefill-0")
    r.add_kvstore("n1", "pdcluster-kvstore-n1")
    m = ClusterManifest.from_dict(r.manifest())
    assert m.prefill == ("prefill-1",) and m.draining == () and m.version == 4
    assert m.kvstores == {"n1": "pdcluster-kvstore-n1"}
    assert r.worker_config() == '{"kvstore": {"token": "t"}}'


def test_a_new_worker_never_takes_a_stopped_ones_name():
    r = ClusterRecord(ClusterManifest("{}", ("prefill-0", "prefill-1"), ("decode-0",), {},
                                      next_index={"prefill": 2, "decode": 1}).to_dict())
    r.remove_worker("prefill-1")
    assert r.next_name("prefill") == "prefill-2" and r.next_name("prefill") == "prefill-3"
    assert r.next_name("decode") == "decode-1"
