#!/usr/bin/env bash
# Entrypoint of the pdcluster images: one role per container.
#
#   serve     pdcluster serve on a local Ray: one machine, no other service  (default)
#   head      Ray head, no worker actors on it (RAY_PORT, default 6379)
#   prefill   Ray worker node offering the "prefill" role (joins RAY_ADDRESS)
#   decode    Ray worker node offering the "decode" role  (joins RAY_ADDRESS)
#   gateway   joins RAY_ADDRESS as a CPU-less node (object store RAY_OBJECT_STORE_MEMORY
#             bytes, default 256 MiB), then runs the gateway, which is the Ray driver:
#             pdcluster serve --address auto (a driver needs a raylet on its own machine)
#   other     run as a command, e.g. `pdcluster bench ...` or `bash`
#
# Extra arguments go to `ray start` (head, prefill, decode) or to `pdcluster serve` (serve,
# gateway). On prefill/decode nodes RAY_CPUS=LIST keeps Ray's processes on those cores, to
# pair with `--cpu-bind` naming the rest for the engines. Role resource names are deploy/placement.py's PREFILL and DECODE. Ray ports must
# be on a trusted network; with Ray's token auth set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN on
# every node (docs/deploy.md, "Network and security").
set -euo pipefail

role="${1:-serve}"
[ $# -gt 0 ] && shift

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
    # RAY_CPUS (a cpu list): Ray's own processes (raylet, agents, and the workers' threads
    # other than the engine's) run on these cores only. The engines then pin their torch
    # threads to the cores `pdcluster serve --cpu-bind LIST` names, which may lie outside
    # this set (engine.cpu_binding).
    affinity=()
    [ -n "${RAY_CPUS:-}" ] && affinity=(taskset -c "$RAY_CPUS")
    exec "${affinity[@]}" ray start --address="${RAY_ADDRESS:?set RAY_ADDRESS to the head, host:port}" \
      --resources="{\"$role\": 1}" --disable-usage-stats --block "$@" ;;
  gateway)
    ray start --address="${RAY_ADDRESS:?set RAY_ADDRESS to the head, host:port}" \
      --num-cpus=0 --object-store-memory="${RAY_OBJECT_STORE_MEMORY:-268435456}" \
      --disable-usage-stats
    exec pdcluster serve --address auto --host 0.0.0.0 "$@" ;;
  *)
    exec "$role" "$@" ;;
esac
