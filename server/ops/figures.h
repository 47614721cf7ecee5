// What Stat answers and /metrics renders, in the daemon's own terms: the Store fills it, the gRPC
// service writes it as a StatResponse (server/rpc/wire_results.h), metrics.cc renders it.
#ifndef TENSORSHM_SERVER_OPS_FIGURES_H_
#define TENSORSHM_SERVER_OPS_FIGURES_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <vector>

namespace tensorshm {

// One device's pool (StatResponse.pools).
struct PoolFigures {
  DLDevice device{};
  int64_t capacity_bytes = 0;
  int64_t used_bytes = 0;   // tensors' buffers, published or not (stock not included)
  int64_t stock_bytes = 0;  // stocked buffers (0 on CUDA)
  int64_t segments = 0;
  int64_t largest_free_bytes = 0;
};

struct StoreFigures {
  int64_t tensors = 0;
  int64_t names = 0;
  int64_t leases = 0;  // RPC leases and lease page slots
  int64_t sessions = 0;
  int64_t evicted_tensors = 0;
  int64_t evicted_bytes = 0;
  int64_t creates_waiting = 0;
  int64_t stocked_tensors = 0;
  std::vector<PoolFigures> pools;  // the host pool first, then each CUDA pool
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_FIGURES_H_
