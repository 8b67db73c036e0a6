"""deploy/k8s, offline: both overlays render with `kubectl kustomize`; every core object
validates against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields
fail); the RayCluster validates against KubeRay v1.7.0's CRD (tests/deploy/data/kuberay, copied
with its source note from the workspace's shared/schemas/kuberay); and the objects agree with
each other, with the gateway's ServeConfig and with the installed Ray: ports, labels, selectors,
config keys, secrets, volumes and image tags.

kubectl (with its built-in kustomize v5) is a system tool, not a Python package: without it the
rendering tests skip, and the base objects are still validated as written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

import pdcluster
from pdcluster.deploy import placement
from pdcluster.deploy.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERAY = Path(__file__).parent / "data" / "kuberay"
KUBECTL = shutil.which("kubectl")
# the oldest and newest Kubernetes minors the manifests are checked against
K8S_VERSIONS = ("1.29.0", "1.37.0")
FLAVOR = {"cpu": "cpu", "gpu": "cuda"}  # overlay -> image tag suffix (deploy/docker)
NOT_CORE = {"RayCluster", "PodMonitor"}  # custom resources: checked by their own schema


def render(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize v5) not installed")


@pytest.fixture(scope="module", params=sorted(FLAVOR))
def overlay(request) -> tuple[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl (kustomize v5) not installed")
    return request.param, render(K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def with_all_components() -> list[dict]:
    """The cpu overlay plus every optional component (ingress, Redis persistence)."""
    if KUBECTL is None:
        pytest.skip("kubectl (kustomize v5) not installed")
    return render(Path(__file__).parent / "data" / "k8s-all-components")


def base_objects() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [d for f in kustomization["resources"]
            for d in yaml.safe_load_all((K8S / "base" / f).read_text()) if d]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = by_kind(objs, kind)
    return found[name] if name else next(iter(found.values()))


# ---- schemas ---------------------------------------------------------------------------------

def validate_core(objs: list[dict]) -> None:
    import kubernetes_validate

    for obj in objs:
        if obj["kind"] in NOT_CORE:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): "
                            f"{exc.message} at {'/'.join(map(str, exc.path))}")


@functools.cache
def raycluster_schema() -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((KUBERAY / "ray.io_rayclusters.yaml").read_text(), Loader=loader)
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"][
        "openAPIV3Schema"]


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the CRD's structural schema does not declare: the API server would silently drop
    them (jsonschema alone accepts them, as CRD schemas set no additionalProperties: false)."""
    out: list[str] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return out
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out += unknown_fields(value, props[key], f"{path}/{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{path}/{key}")
            elif props is not None and key not in props and extra is None:
                out.append(f"{path}/{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            out += unknown_fields(item, schema["items"], f"{path}/{i}")
    return out


def validate_raycluster(rc: dict) -> None:
    schema = raycluster_schema()
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(rc)]
    assert not errors, errors
    assert not unknown_fields({k: v for k, v in rc.items() if k != "metadata"}, schema)


def test_kuberay_crds_are_the_v1_7_0_files_of_the_note():
    note = (KUBERAY / "README.md").read_text()
    assert "KubeRay v1.7.0" in note
    for name in ("ray.io_rayclusters.yaml", "ray.io_rayservices.yaml"):
        digest = hashlib.sha256((KUBERAY / name).read_bytes()).hexdigest()
        assert f"`{name}` | {(KUBERAY / name).stat().st_size} | `{digest}`" in note


def test_base_objects_validate_without_kustomize():
    objs = base_objects()
    validate_core(objs)
    validate_raycluster(one(objs, "RayCluster"))


def test_unknown_raycluster_field_is_caught():
    rc = one(base_objects(), "RayCluster")
    rc["spec"]["headGroupSpec"]["rayStartParam"] = {}  # a typo the API server would drop
    with pytest.raises(AssertionError):
        validate_raycluster(rc)


@needs_kubectl
def test_overlay_objects_validate(overlay):
    name, objs = overlay
    assert {o["kind"] for o in objs} >= {"Namespace", "RayCluster", "Deployment", "Service",
                                          "ConfigMap", "Secret", "NetworkPolicy", "PodMonitor"}
    validate_core(objs)
    validate_raycluster(one(objs, "RayCluster"))


@needs_kubectl
def test_optional_components_validate_and_point_at_the_gateway(with_all_components):
    objs = with_all_components
    validate_core(objs)
    ingress = one(objs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    service = one(objs, "Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    redis = one(objs, "Deployment", "pdcluster-redis")["spec"]["template"]["spec"]
    claim = redis["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim in by_kind(objs, "PersistentVolumeClaim")
    assert "--appendonly" in redis["containers"][0]["args"]


# ---- wiring -----------------------------------------------------------------------------------

def quantity(q) -> float:
    """A Kubernetes quantity ("1280Mi", "8Gi", "4", "250m") as a number (bytes, cores)."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q))
    assert m, q
    units = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return float(m.group(1)) * units[m.group(2)]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def config_of(objs: list[dict], tmp_path: Path):
    gateway = one(objs, "Deployment", "pdcluster-gateway")["spec"]["template"]["spec"]
    container = gateway["containers"][0]
    args = container["args"]
    path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if path.parent == Path(m["mountPath"]))
    volume = next(v for v in gateway["volumes"] if v["name"] == mount["name"])
    data = one(objs, "ConfigMap", volume["configMap"]["name"])["data"]
    (tmp_path / path.name).write_text(data[path.name])
    return load_config(tmp_path / path.name, {})  # every key is a ServeConfig field


def ray_pods(rc: dict) -> dict[str, dict]:
    """group name ('head', 'prefill', 'decode') -> pod template."""
    groups = {"head": rc["spec"]["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]})
    return {name: g["template"] for name, g in groups.items()}


def start_resources(group: dict) -> dict:
    raw = group["rayStartParams"].get("resources", "{}")
    return json.loads(raw.strip("'\" "))


@needs_kubectl
def test_ray_version_images_and_roles(overlay):
    name, objs = overlay
    rc = one(objs, "RayCluster")
    pins = dict(line.split("==") for line in
                (ROOT / "deploy" / "docker" / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert rc["spec"]["rayVersion"] == ray.__version__ == pins["ray"]

    version = pdcluster.__version__
    gateway = one(objs, "Deployment", "pdcluster-gateway")["spec"]["template"]["spec"]
    images = {c["image"] for t in ray_pods(rc).values() for c in t["spec"]["containers"]}
    images |= {c["image"] for c in gateway["containers"]}
    assert images == {f"pdcluster:{version}-{FLAVOR[name]}"}
    redis = one(objs, "Deployment", "pdcluster-redis")["spec"]["template"]["spec"]
    tag = redis["containers"][0]["image"].rpartition(":")[2]
    assert re.fullmatch(r"\d+\.\d+\.\d+(-\w+)?", tag), tag  # pinned, never latest

    # KubeRay keeps our command (the entrypoint's kuberay role runs its generated ray start)
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for template in ray_pods(rc).values():
        for container in template["spec"]["containers"]:
            assert container["command"] == ["/usr/local/bin/pdcluster-entrypoint"]
            assert container["args"] == ["kuberay"]

    head, workers = rc["spec"]["headGroupSpec"], rc["spec"]["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert not set(start_resources(head)) & set(placement.ROLES)
    assert sorted(g["groupName"] for g in workers) == sorted(placement.ROLES)
    for group in workers:
        assert start_resources(group) == {group["groupName"]: 1}


@needs_kubectl
def test_gateway_service_probes_config_and_secrets(overlay, tmp_path):
    name, objs = overlay
    cfg = config_of(objs, tmp_path)
    deployment = one(objs, "Deployment", "pdcluster-gateway")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert selects(deployment["spec"]["selector"], pod["metadata"]["labels"])
    # replicas that own no worker: rolled one at a time, at least one through disruptions
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pdb = one(objs, "PodDisruptionBudget", "pdcluster-gateway")["spec"]
    assert pdb["minAvailable"] == 1 and selects(pdb["selector"], pod["metadata"]["labels"])
    assert container["args"][0] == "gateway"  # deploy/docker/entrypoint.sh role
    # the workers are brought up by a Job of their own, on the same config and Ray
    job = one(objs, "Job", "pdcluster-cluster-up")["spec"]["template"]["spec"]
    up = job["containers"][0]
    assert up["args"][:3] == ["cluster-up", "--config", container["args"][2]]
    assert {e["name"]: e for e in up["env"]} == {e["name"]: e for e in container["env"]}
    assert {v["name"]: v for v in job["volumes"]}["config"] == \
        {v["name"]: v for v in pod["spec"]["volumes"]}["config"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert cfg.host == "0.0.0.0" and ports["http"] == cfg.port

    service = one(objs, "Service", "pdcluster-gateway")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe

    env = {e["name"]: e for e in container["env"]}
    rc = one(objs, "RayCluster")
    head_ports = {p["name"]: p["containerPort"] for p in
                  rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert env["RAY_ADDRESS"]["value"] == (f"{rc['metadata']['name']}-head-svc:"
                                           f"{head_ports['gcs-server']}")
    assert env["RAY_AUTH_MODE"]["value"] == rc["spec"]["authOptions"]["mode"] == "token"
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": rc["spec"]["authOptions"]["secretName"], "key": "auth_token"}
    assert ref["key"] in one(objs, "Secret", ref["name"])["data"]

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    key_volume = next(n for n, v in volumes.items() if "secret" in v)
    secret = volumes[key_volume]["secret"]
    item = next(i for i in secret["items"]
                if f"{mounts[key_volume]}/{i['path']}" == cfg.api_key_file)
    assert item["key"] in one(objs, "Secret", secret["secretName"])["data"]
    shm = volumes[next(n for n, p in mounts.items() if p == "/dev/shm")]["emptyDir"]
    assert quantity(shm["sizeLimit"]) >= int(env["RAY_OBJECT_STORE_MEMORY"]["value"])


@needs_kubectl
def test_kv_index_is_the_redis_service(overlay, tmp_path):
    name, objs = overlay
    cfg = config_of(objs, tmp_path)
    m = re.fullmatch(r"redis://([\w.-]+):(\d+)/\d+", cfg.kvpool.index_url)
    assert m, cfg.kvpool.index_url
    service = one(objs, "Service", m.group(1))
    port = next(p for p in service["spec"]["ports"] if p["port"] == int(m.group(2)))
    redis = one(objs, "Deployment", "pdcluster-redis")["spec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, redis["metadata"]["labels"])
    assert port["targetPort"] in {p["name"] for p in redis["spec"]["containers"][0]["ports"]}


@needs_kubectl
def test_worker_pods_fit_the_config(overlay, tmp_path):
    name, objs = overlay
    cfg = config_of(objs, tmp_path)
    rc = one(objs, "RayCluster")
    instances = {"prefill": cfg.prefill_instances, "decode": cfg.decode_instances}
    gpu = cfg.engine.device.startswith("cuda")
    for group in rc["spec"]["workerGroupSpecs"]:
        role, pod = group["groupName"], group["template"]["spec"]
        container = pod["containers"][0]
        limits = container["resources"]["limits"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        # G2 arena and Ray's object store both live in /dev/shm, inside the memory limit
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        store = int(group["rayStartParams"]["object-store-memory"])
        assert shm["medium"] == "Memory"
        assert quantity(shm["sizeLimit"]) >= cfg.kvpool.dram_cache_bytes + store, role
        assert quantity(limits["memory"]) > quantity(shm["sizeLimit"]), role
        # G3 slabs on the kv-ssd volume, big enough
        ssd = volumes[mounts[cfg.kvpool.ssd_cache_dir]]
        storage = ssd["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]
        assert quantity(storage["storage"]) >= cfg.kvpool.ssd_cache_bytes, role
        # every configured actor of the role finds room: no actor left pending; the pod's
        # CPU limit is Ray's CPUs plus the cores kept for Ray's own processes
        cpus = int(group["rayStartParams"]["num-cpus"])
        assert instances[role] * cfg.actor_num_cpus <= group["minReplicas"] * cpus, role
        # what the SLO planner may add fits the pods Ray's autoscaler may add
        scale = cfg.autoscale_range()
        if scale is not None:
            assert rc["spec"]["enableInTreeAutoscaling"] is True
            bounds = scale.of(role)
            assert bounds.minimum <= instances[role] <= bounds.maximum, role
            assert bounds.maximum * cfg.actor_num_cpus <= group["maxReplicas"] * cpus, role
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        reserved = int(env["RAY_RESERVED_CPUS"])
        assert reserved >= 1 and quantity(limits["cpu"]) == cpus + reserved, role
        assert container["resources"]["requests"]["cpu"] == limits["cpu"], role
        gpus = quantity(limits.get("nvidia.com/gpu", 0))
        if gpu:
            assert instances[role] <= group["minReplicas"] * gpus, role
            assert scale is None or scale.of(role).maximum <= group["maxReplicas"] * gpus, role
            assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu"
                                               for t in pod["tolerations"]), role
        else:
            assert gpus == 0 and "nodeSelector" not in pod, role
    assert gpu == (name == "gpu")


@needs_kubectl
def test_labels_selectors_and_monitoring(overlay):
    name, objs = overlay
    rc = one(objs, "RayCluster")
    pods = {f"ray-{g}": t for g, t in ray_pods(rc).items()}
    for deployment in by_kind(objs, "Deployment").values():
        pods[deployment["metadata"]["name"]] = deployment["spec"]["template"]
    for policy in by_kind(objs, "NetworkPolicy").values():
        assert any(selects(policy["spec"]["podSelector"], p["metadata"]["labels"])
                   for p in pods.values()), policy["metadata"]["name"]
    internal = by_kind(objs, "NetworkPolicy")["pdcluster-internal"]["spec"]["podSelector"]
    assert all(selects(internal, p["metadata"]["labels"]) for p in pods.values())

    # KubeRay labels every Ray pod ray.io/cluster=<name>; the gateway PodMonitor's port exists
    secret = one(objs, "Secret", "pdcluster-api-keys")["data"]
    for monitor in by_kind(objs, "PodMonitor").values():
        selector, endpoint = monitor["spec"]["selector"], monitor["spec"]["podMetricsEndpoints"][0]
        if "ray.io/cluster" in selector["matchLabels"]:
            assert selector["matchLabels"]["ray.io/cluster"] == rc["metadata"]["name"]
            targets = list(ray_pods(rc).values())
        else:
            targets = [p for p in pods.values() if selects(selector, p["metadata"]["labels"])]
        assert targets, monitor["metadata"]["name"]
        for pod in targets:
            assert endpoint["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        if "authorization" in endpoint:  # the key Prometheus sends is one the gateway accepts
            import base64

            ref = endpoint["authorization"]["credentials"]
            key = base64.b64decode(secret[ref["key"]]).decode()
            assert key in base64.b64decode(secret["api-keys"]).decode().splitlines()
