"""Split a worker node's cores between Ray's own processes and the engines, before `ray start`.

    python -m deploy.node_cores --reserve N       # the last N cores go to Ray
    python -m deploy.node_cores --ray-cpus LIST   # these cores go to Ray

Prints the cores for Ray as a cpu list (for `taskset -c`) and declares the others the node's
worker cores (`engine.cpu_binding.CoreClaims.set_worker_cores`), so engines started with
`--cpu-bind auto` claim from them although they inherit Ray's confinement. The node's cores
are the ones this process may run on: in a Kubernetes pod, its cpuset, whatever ids that has.
The images' entrypoint runs it for the prefill and decode roles (deploy/docker/entrypoint.sh).

With `--reserve`, the engines get whole physical cores first (`cpu_binding.split_node_cores`)
and Ray the rest. Exits with status 2 and a message when the split leaves either side empty
or `--ray-cpus` names a core this process may not run on.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdcluster.engine import cpu_binding


def split(cores: list[int], reserve: int | None = None,
          ray_cpus: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(the engines' cores, Ray's cores) of `cores`: Ray gets `ray_cpus`, or `reserve` cores
    that the engines' physical-first choice leaves over. Raises ValueError when either side
    would be empty or `ray_cpus` is not within `cores`."""
    if ray_cpus is not None:
        outside = sorted(set(ray_cpus) - set(cores))
        if outside:
            raise ValueError(f"cores {cpu_binding.format_cpu_list(outside)} are not this "
                             f"node's ({cpu_binding.format_cpu_list(cores)})")
        workers = sorted(set(cores) - set(ray_cpus))
        ray = sorted(ray_cpus)
    else:
        if reserve is None or not 0 < reserve < len(cores):
            raise ValueError(f"cannot reserve {reserve} of {len(cores)} cores for Ray and "
                             f"leave the engines some")
        workers, ray = cpu_binding.split_node_cores(len(cores) - reserve, cores)
    if not workers or not ray:
        raise ValueError(f"no cores left for the {'engines' if not workers else 'Ray'}")
    return workers, ray


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--reserve", type=int, help="cores for Ray's own processes")
    which.add_argument("--ray-cpus", help="a cpu list: Ray's cores")
    parser.add_argument("--claims-dir", type=Path, default=None,
                        help="the node's core-claims directory (default: engine.cpu_binding's)")
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    try:
        ray_cpus = (cpu_binding.parse_cpu_list(args.ray_cpus)
                    if args.ray_cpus is not None else None)
        workers, ray = split(cores, args.reserve, ray_cpus)
    except ValueError as exc:
        print(f"node_cores: {exc}", file=sys.stderr)
        return 2
    cpu_binding.CoreClaims(args.claims_dir).set_worker_cores(workers)
    print(cpu_binding.format_cpu_list(ray))
    return 0


if __name__ == "__main__":
    sys.exit(main())
