"""`pdcluster cluster up|down|status` and `pdcluster gateway`: a cluster that outlives its
gateways.

    pdcluster cluster up [serve's flags]      # workers, KV stores, index: detached actors
    pdcluster gateway --port 8001 [...]       # attaches and serves; run any number of them
    pdcluster cluster status [--json] [--watch S]
    pdcluster cluster down

`cluster up` brings the workers up as detached named actors in the deployment's Ray namespace
and records the deployment there (deploy.cluster_record), then exits. With no `--address` it
first starts a local Ray that outlives it (deploy.local_ray.LocalHead: loopback only, token
authentication) and writes where it is and its token to a state file, mode 0600, which the
other commands read: ``$PDCLUSTER_STATE_DIR/<namespace>.json`` (default ``~/.pdcluster``).
With `--address` it joins that cluster, whose token the environment gives as for `serve`.

A gateway takes the cluster's settings from the record and only its own (GATEWAY_FIELDS) from
its flags. Killing a gateway costs its own streams and nothing else: the workers, their
caches and models stay, and any gateway (a restarted one too) serves on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.deploy.cluster_record import ClusterManifest

log = logging.getLogger(__name__)

STATE_DIR_ENV = "PDCLUSTER_STATE_DIR"
#: ServeConfig fields a gateway sets for itself; the rest are the cluster's.
GATEWAY_FIELDS = frozenset({
    "host", "port", "served_model_name", "policy", "pd_decider", "admission", "slo_ttft_s",
    "slo_tbt_ms", "cost_model", "log_level", "log_format", "drain_timeout_s",
    "max_inflight_requests", "max_queued_sequences", "max_seqs_per_request", "header_timeout_s",
    "body_timeout_s", "keep_alive_timeout_s", "max_connections", "max_request_body_bytes",
    "api_keys", "api_key_file",
    "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser", "worker_stall_timeout_s",
    "address", "ray_namespace", "autoscale", "autoscale_interval_s"})


def state_path(namespace: str) -> Path:
    base = os.environ.get(STATE_DIR_ENV) or Path.home() / ".pdcluster"
    return Path(base) / f"{namespace}.json"


def _read_state(namespace: str) -> dict | None:
    path = state_path(namespace)
    return json.loads(path.read_text()) if path.exists() else None


def _write_state(namespace: str, state: dict) -> None:
    path = state_path(namespace)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the Ray token
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)


def _join(address: str | None, namespace: str):
    """ray.init on the cluster: `address`, else the local one `cluster up` started (its
    token and loopback switch set in the environment before ray is imported). Returns the
    state file's content (None when an address was given or there is none). Raises
    ClusterNotFoundError when there is nothing to join."""
    from pdcluster.deploy.cluster_record import ClusterNotFoundError

    state = None
    if address is None:
        state = _read_state(namespace)
        if state is None:
            raise ClusterNotFoundError(
                f"no local pdcluster cluster for namespace {namespace!r} ({state_path(namespace)} "
                f"is missing): run `pdcluster cluster up`, or pass --address")
        os.environ.update(state["env"])
        address = state["address"]
    import ray

    from pdcluster.deploy.local_ray import loopback_node_ip

    # joining a loopback head, this process must take the loopback IP too (deploy.local_ray)
    loopback = address.split(":")[0] in ("127.0.0.1", "localhost")
    with loopback_node_ip() if loopback else contextlib.nullcontext():
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    return state


def local_head_env(token: str) -> dict[str, str]:
    """The environment of a local head and of every process joining it, set before ray is
    imported: Ray's switch for a loopback node IP (deploy.local_ray) and token auth."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token}


def cluster_up(config) -> int:
    """Bring the workers up detached; print the address. 1 when a local cluster is recorded
    already. With --autoscale the counts start within its range, and the record carries it
    to every gateway, which scale it (deploy.autoscaler: one at a time)."""
    namespace = config.ray_namespace
    head = None
    if config.address is None:
        if _read_state(namespace) is not None:
            print(f"pdcluster: a local cluster is recorded in {state_path(namespace)} "
                  f"(`pdcluster cluster status`; `pdcluster cluster down` first)",
                  file=sys.stderr)
            return 1
        env = local_head_env(os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16))
        os.environ.update(env)  # before ray is imported: the head and this driver read it
        from pdcluster.deploy import placement
        from pdcluster.deploy.local_ray import start_local_head
        from pdcluster.deploy.ray_session import cpu_plan

        _, ray_cpus = cpu_plan(config)
        path = state_path(namespace)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        head = start_local_head(config.local_ray_num_cpus(), placement.local_node_resources(),
                                str(path.with_suffix(".ray.log")), ray_cpus)
        _write_state(namespace, {"address": head.address, "pid": head.pid,
                                 "temp_dir": head.temp_dir, "env": env})
        try:
            _join(None, namespace)
        except BaseException:
            _stop_local(namespace, head.pid, head.temp_dir)
            raise
    else:
        _join(config.address, namespace)
        from pdcluster.deploy.cluster_record import ClusterNotFoundError, read_record

        try:
            read_record(namespace)
        except ClusterNotFoundError:
            pass
        else:  # up already: a re-run (a Kubernetes Job's retry) changes nothing
            print(f"pdcluster cluster up: a cluster runs already in namespace {namespace!r}")
            return 0
    from dataclasses import replace

    from pdcluster.deploy.cluster_record import write_record
    from pdcluster.deploy.launcher import Cluster
    from pdcluster.deploy.ray_session import RaySession

    cluster = Cluster(config, RaySession.joined(config), detached=True)
    try:
        cluster.start_workers()
        cluster.wait_ready()
        manifest = replace(cluster.manifest(),
                           ray_address=head.address if head else config.address)
        write_record(manifest, namespace, cluster.worker_config_json())
    except BaseException:
        _take_down(namespace, cluster=cluster)
        if head is not None:
            _stop_local(namespace, head.pid, head.temp_dir)
        raise
    print(f"pdcluster cluster up: {len(manifest.prefill)} prefill, {len(manifest.decode)} "
          f"decode, Ray at {manifest.ray_address}, namespace {namespace!r}")
    return 0


def cluster_down(address: str | None, namespace: str) -> int:
    """Stop every actor the record lists, remove it; stop the local Ray `up` started."""
    from pdcluster.deploy.cluster_record import ClusterNotFoundError, read_record

    try:
        state = _join(address, namespace)
        manifest = read_record(namespace)
    except ClusterNotFoundError as exc:
        print(f"pdcluster: {exc}", file=sys.stderr)
        return 1
    _take_down(namespace, manifest=manifest)
    if state is not None:  # the local Ray `cluster up` started
        import ray

        ray.shutdown()
        _stop_local(namespace, state["pid"], state.get("temp_dir"))
    print(f"pdcluster cluster down: namespace {namespace!r} stopped")
    return 0


def _take_down(namespace: str, manifest=None, cluster=None) -> None:
    """Kill the cluster's actors (those its record lists, or a Cluster half started) and its
    record."""
    from pdcluster.deploy.cluster_record import remove_record

    if cluster is None:
        from pdcluster.deploy.launcher import Cluster

        config = gateway_config(manifest.config_json, {"ray_namespace": namespace})
        cluster = Cluster.of_manifest(config, manifest)
    cluster.shutdown_workers()
    remove_record(namespace)


def _stop_local(namespace: str, pid: int, temp_dir: str | None) -> None:
    from pdcluster.deploy.local_ray import stop_local_head

    stop_local_head(pid, temp_dir)
    state_path(namespace).unlink(missing_ok=True)


def cluster_status(address: str | None, namespace: str, as_json: bool,
                   watch_s: float | None = None) -> int:
    """Each worker's role, instance, pid, node, state, running/waiting counts (and, in the
    JSON, prompts computed and engine steps run since it started; the draining ones). With
    `watch_s`, again every `watch_s` seconds (the record re-read: workers an autoscaler adds
    appear) until interrupted, as `kubectl get --watch`; with `as_json`, one line each."""
    from pdcluster.deploy.cluster_record import ClusterNotFoundError, read_record

    try:
        _join(address, namespace)
        while True:
            _print_status(namespace, read_record(namespace), as_json)
            if watch_s is None:
                return 0
            time.sleep(watch_s)
    except ClusterNotFoundError as exc:
        print(f"pdcluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _print_status(namespace: str, manifest: ClusterManifest, as_json: bool) -> None:
    import ray

    rows = []
    for role, names in (("prefill", manifest.prefill), ("decode", manifest.decode)):
        for name in names:
            row = {"role": role, "instance": name, "pid": None, "node": None,
                   "state": "unreachable", "running": None, "waiting": None,
                   "requests_total": None, "steps_total": None,
                   "draining": name in manifest.draining}
            try:
                handle = ray.get_actor(name, namespace=namespace)
                info, stats = ray.get([handle.info.remote(), handle.stats.remote()], timeout=10)
                row.update(pid=info["pid"], node=info["node_id"], state="alive",
                           running=stats.num_running, waiting=stats.num_waiting,
                           requests_total=stats.num_requests_total,
                           steps_total=stats.num_steps_total + stats.num_prefill_steps_total)
            except ValueError:
                row["state"] = "missing"
            except Exception as exc:  # noqa: BLE001 — shown as its state
                row["state"] = f"unreachable ({type(exc).__name__})"
            rows.append(row)
    summary = {"namespace": namespace, "ray_address": manifest.ray_address,
               "started_at": manifest.started_at, "workers": rows}
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    print(f"namespace {namespace!r}, Ray at {manifest.ray_address}, up since "
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.started_at))}")
    print(f"{'role':8} {'instance':12} {'pid':>8} {'node':14} {'state':12} {'running':>8} "
          f"{'waiting':>8}")
    for r in rows:
        print(f"{r['role']:8} {r['instance']:12} {r['pid'] or '-':>8} "
              f"{(r['node'] or '-')[:12]:14} {r['state']:12} "
              f"{'-' if r['running'] is None else r['running']:>8} "
              f"{'-' if r['waiting'] is None else r['waiting']:>8}", flush=True)


def gateway_config(manifest_config_json: str, overrides: dict):
    """The cluster's ServeConfig with a gateway's own settings over it. Raises ValueError
    naming a cluster setting given to a gateway."""
    from pdcluster.deploy.config import ServeConfig

    foreign = sorted(set(overrides) - GATEWAY_FIELDS)
    if foreign:
        raise ValueError(f"{', '.join(foreign)}: the cluster's settings, fixed by "
                         f"`pdcluster cluster up`; a gateway sets only its own")
    cluster = json.loads(manifest_config_json)
    for secret in ("kvstore",):  # masked in the record; a gateway never needs the KV token
        cluster.get(secret, {}).pop("token", None)
    cluster.pop("api_keys", None)
    return ServeConfig.model_validate({**cluster, **overrides})


def gateway(overrides: dict, config_file: str | None = None) -> int:
    """Attach to the running cluster and serve until SIGINT/SIGTERM (the cluster stays).
    `config_file`: a ServeConfig YAML (the cluster's own, say) whose gateway settings are
    taken; flags win."""
    from pdcluster.deploy.cluster_record import ClusterNotFoundError, read_record
    from pdcluster.deploy.config import ServeConfig

    if config_file is not None:
        import yaml

        with open(config_file) as f:
            data = yaml.safe_load(f) or {}
        overrides = {**{k: v for k, v in data.items() if k in GATEWAY_FIELDS}, **overrides}

    namespace = overrides.get("ray_namespace") or ServeConfig().ray_namespace
    try:
        _join(overrides.get("address"), namespace)
        manifest = read_record(namespace)
    except ClusterNotFoundError as exc:
        print(f"pdcluster: {exc}", file=sys.stderr)
        return 1
    try:
        config = gateway_config(manifest.config_json, overrides)
    except ValueError as exc:
        print(f"pdcluster: invalid configuration: {exc}", file=sys.stderr)
        return 2
    from pdcluster.engine.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    from pdcluster.deploy.launcher import Cluster
    from pdcluster.deploy.ray_session import RaySession
    from pdcluster.deploy.serve import serve_gateway

    return serve_gateway(config, Cluster.attach(config, manifest, RaySession.joined(config)))
