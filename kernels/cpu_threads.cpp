// Pinning of the OpenMP team that runs torch's CPU ops, one thread per core.
//
// torch's intra-op threads are libgomp's team of the thread that first runs a parallel
// region; libgomp keeps that team's threads in a pool and reuses them, in the same order,
// for every later region of the same size. Setting each member's affinity from inside one
// region of torch's thread count therefore pins the team that every later op runs on. It
// has to be done here, in a parallel region: sched_setaffinity acts on the calling thread
// only, and the team's threads are not visible from Python.
#include <omp.h>
#include <sched.h>
#include "cpu_tensor.h"

#include <vector>

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n > 0, "bind_omp_threads: no cpus given");
  std::vector<int64_t> placed(n, -1);
  int team = 0;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
#pragma omp single
    team = omp_get_num_threads();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) placed[t] = sched_getcpu();
  }
  TORCH_CHECK(team == n, "bind_omp_threads: OpenMP gave a team of ", team, " threads, not ", n);
  return placed;
}
