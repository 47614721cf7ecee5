// The roles handoff_bench runs in its child processes (handoff_bench.cc is the driver that
// spawns them and prints the table), and what the driver shares with them.
#ifndef TENSORSHM_BENCH_HANDOFF_ROLES_H_
#define TENSORSHM_BENCH_HANDOFF_ROLES_H_

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/cuda/cuda_driver.h"

namespace handoff {

// The median of `values` (0 for none).
double Median(std::vector<int64_t> values);
// Prints `status` (the client's tensorshm::Status, or the CUDA helpers' absl one) and exits 1.
template <typename AnyStatus>
[[noreturn]] void Die(const AnyStatus& status) {
  std::cerr << "handoff_bench: " << status << "\n";
  std::exit(1);
}
// The CUDA driver, or Die.
const tensorshm::CudaDriver* DriverOrDie();
// Why the CUDA row cannot run here, or OK.
absl::Status CudaAvailable();

// The roles (`handoff_bench --role NAME SOCKET SIZE ITERATIONS`): each talks with the driver over
// its stdin and stdout, and returns the process's exit status.
int TsmProducer(const std::string& socket, uint64_t size, int iterations);
int TsmConsumer(const std::string& socket, uint64_t size, int iterations);
int WarmMemcpy(uint64_t size, int iterations);
int CudaProducer(const std::string& socket, uint64_t size, int iterations);
int CudaConsumer(const std::string& socket, uint64_t size, int iterations);
int GrpcConsumer(const std::string& socket);
int GrpcProducer(const std::string& socket, uint64_t size, int iterations);

}  // namespace handoff

#endif  // TENSORSHM_BENCH_HANDOFF_ROLES_H_
