// acquire_pairs: warm acquire + release of one published tensor, in a loop, in one process; prints
// the median and the mean per pair. Made to be run under `strace -c -f` (or `perf stat`): the
// system calls it counts come from connecting and publishing, none from the pairs, so their
// number does not grow with --pairs.
//
//   acquire_pairs --socket PATH [--pairs N] [--bytes B]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "tensorshm/client.h"

namespace {

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

int Usage() {
  std::fprintf(stderr, "usage: acquire_pairs --socket PATH [--pairs N] [--bytes B]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket;
  long pairs = 100000;
  long bytes = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--socket") {
      socket = argv[i + 1];
    } else if (flag == "--pairs") {
      pairs = std::strtol(argv[i + 1], nullptr, 10);
    } else if (flag == "--bytes") {
      bytes = std::strtol(argv[i + 1], nullptr, 10);
    } else {
      return Usage();
    }
  }
  if (socket.empty() || pairs <= 0 || bytes <= 0) return Usage();
  auto client = tensorshm::Client::Connect({socket, "acquire_pairs"});
  if (!client.ok()) {
    std::fprintf(stderr, "acquire_pairs: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto tensor = (*client)->Create({{kDLUInt, 8, 1}, {bytes}});
  if (!tensor.ok()) return 1;
  std::memset(tensor->data(), 7, static_cast<size_t>(bytes));
  if (!(*client)->Publish(*tensor, "acquire_pairs/x", /*replace=*/true).ok()) return 1;
  // Warm: the segment mapping is made by the first acquire.
  auto first = (*client)->Acquire("acquire_pairs/x");
  if (!first.ok()) return 1;
  (*first)->deleter(*first);

  std::vector<int64_t> samples;
  samples.reserve(static_cast<size_t>(pairs));
  uint64_t sink = 0;
  const int64_t start = NowNs();
  for (long i = 0; i < pairs; ++i) {
    const int64_t t0 = NowNs();
    auto leased = (*client)->Acquire("acquire_pairs/x");
    if (!leased.ok()) {
      std::fprintf(stderr, "acquire_pairs: %s\n", leased.status().ToString().c_str());
      return 1;
    }
    sink += static_cast<const unsigned char*>((*leased)->dl_tensor.data)[0];
    (*leased)->deleter(*leased);
    samples.push_back(NowNs() - t0);
  }
  const int64_t total = NowNs() - start;
  std::sort(samples.begin(), samples.end());
  std::printf("acquire + release pairs: %ld, median %.2f us, mean %.2f us (sink %llu)\n", pairs,
              samples[samples.size() / 2] / 1000.0, total / 1000.0 / static_cast<double>(pairs),
              static_cast<unsigned long long>(sink % 2));
  return 0;
}
