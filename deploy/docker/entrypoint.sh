#!/usr/bin/env bash
# Entrypoint of the pdcluster images: one role per container.
#
#   serve     pdcluster serve on a local Ray: one machine, no other service  (default)
#   head      Ray head, no worker actors on it (RAY_PORT, default 6379)
#   prefill   Ray worker node offering the "prefill" role (joins RAY_ADDRESS)
#   decode    Ray worker node offering the "decode" role  (joins RAY_ADDRESS)
#   gateway   joins RAY_ADDRESS as a CPU-less node (object store RAY_OBJECT_STORE_MEMORY
#             bytes, default 256 MiB), then runs a gateway attached to the running cluster:
#             pdcluster gateway --address auto (a Ray driver needs a raylet on its machine)
#   cluster-up  joins RAY_ADDRESS the same way and runs pdcluster cluster up --address auto:
#             the workers as detached actors, then exits (a no-op when they run already)
#   kuberay   a KubeRay pod's container (RayCluster annotation
#             ray.io/overwrite-container-cmd: "true"): runs the `ray start` KubeRay generated
#             (KUBERAY_GEN_RAY_START_CMD) with the core split below
#   other     run as a command, e.g. `pdcluster bench ...` or `bash`
#
# Extra arguments go to `ray start` (head, prefill, decode) or to pdcluster (serve, gateway,
# cluster-up). Role resource names are deploy/placement.py's PREFILL and DECODE. Ray ports must
# be on a trusted network; with Ray's token auth set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN on
# every node (docs/deployment.md, "Network and security").
#
# Core split on prefill/decode nodes (and kuberay pods): RAY_RESERVED_CPUS=N keeps Ray's own
# processes (raylet, agents, the workers' threads other than the engine's) on N of the
# container's cores, RAY_CPUS=LIST on those cores; deploy/node_cores.py declares the other
# cores the engines' (`--cpu-bind auto` claims from them, engine.cpu_binding).
set -euo pipefail

role="${1:-serve}"
[ $# -gt 0 ] && shift

# sets `affinity` to the taskset prefix that confines Ray to its share of the cores (none
# when neither RAY_CPUS nor RAY_RESERVED_CPUS is set)
ray_affinity() {
  affinity=()
  local split=()
  if [ -n "${RAY_CPUS:-}" ]; then
    split=(--ray-cpus "$RAY_CPUS")
  elif [ -n "${RAY_RESERVED_CPUS:-}" ] && [ "$RAY_RESERVED_CPUS" != 0 ]; then
    split=(--reserve "$RAY_RESERVED_CPUS")
  else
    return 0
  fi
  local ray_cpus
  ray_cpus="$(python -m pdcluster.deploy.node_cores "${split[@]}")"
  affinity=(taskset -c "$ray_cpus")
}

case "$role" in
  serve)
    exec pdcluster serve --host 0.0.0.0 "$@" ;;
  head)
    exec ray start --head --port="${RAY_PORT:-6379}" --num-cpus=0 --dashboard-host=127.0.0.1 \
      --disable-usage-stats --block "$@" ;;
  prefill | decode)
    # the engines are this node's workload: at Ray's default worker niceness (15) every
    # other process's wake-up preempts their compute threads (deploy/local_ray.py)
    export RAY_worker_niceness="${RAY_worker_niceness:-0}"
    ray_affinity
    exec "${affinity[@]}" ray start --address="${RAY_ADDRESS:?set RAY_ADDRESS to the head, host:port}" \
      --resources="{\"$role\": 1}" --disable-usage-stats --block "$@" ;;
  gateway | cluster-up)
    ray start --address="${RAY_ADDRESS:?set RAY_ADDRESS to the head, host:port}" \
      --num-cpus=0 --object-store-memory="${RAY_OBJECT_STORE_MEMORY:-268435456}" \
      --disable-usage-stats
    if [ "$role" = gateway ]; then
      exec pdcluster gateway --address auto --host 0.0.0.0 "$@"
    fi
    exec pdcluster cluster up --address auto "$@" ;;
  kuberay)
    # KubeRay's own container command starts with this; with the annotation it is ours to run
    ulimit -n 65536 2>/dev/null || true
    export RAY_worker_niceness="${RAY_worker_niceness:-0}"
    ray_affinity
    # the generated command is one shell string, its quoted JSON resources included
    exec "${affinity[@]}" bash -c "${KUBERAY_GEN_RAY_START_CMD:?not started by KubeRay with ray.io/overwrite-container-cmd}" ;;
  *)
    exec "$role" "$@" ;;
esac
