// The OpenMP pieces every CPU kernel shares: when a loop goes parallel, how many threads there
// are, which one is running, and a scratch buffer per thread.
#pragma once

#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyprune_cpu {

// Loops over fewer elements than this run on one thread (thread start-up would dominate).
constexpr int64_t kParallelMin = 32768;

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// `per_thread` elements of scratch for each of `threads` threads, in one allocation; inside the
// parallel region, mine() is the calling thread's share.
template <typename T>
class PerThreadScratch {
 public:
  PerThreadScratch(int threads, int64_t per_thread)
      : per_thread_(per_thread), data_(static_cast<size_t>(threads * per_thread)) {}
  T* mine() { return data_.data() + thread_id() * per_thread_; }

 private:
  int64_t per_thread_;
  std::vector<T> data_;
};

}  // namespace pyprune_cpu
