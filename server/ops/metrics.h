// tensorshmd's Prometheus figures: the counters and the histogram the service updates as calls
// end, and their rendering in the Prometheus text exposition format (0.0.4). The gauges (pools,
// tensors, names, leases, sessions) are not kept here: they are read, as Stat reads them, when
// the figures are rendered. The HTTP side is metrics_http.h.
#ifndef TENSORSHM_SERVER_OPS_METRICS_H_
#define TENSORSHM_SERVER_OPS_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "server/ops/figures.h"

namespace tensorshm {

// Why a connection was closed at accept (ConnectionTable::Check). kNone: it was not.
enum class ConnectionRefusal { kNone, kNotAdmitted, kUidLimit, kDaemonLimit, kCount };

// The operations counted, by the request that asked for them: a gRPC call or a memory channel
// request (create, publish and delete come both ways and are counted alike).
enum class MetricOp : int {
  kCreate,
  kPublish,
  kAcquire,
  kDelete,
  kList,
  kStat,
  kSessionOpen,
  kRelease,   // a release batch on a session stream
  kBind,      // memory channel: bind to a session
  kSegment,   // memory channel: a host segment's descriptor
  kFastPath,  // memory channel: a part of the fast path (index, records, lease page)
  kUnknown,   // a memory channel request of no kind this daemon knows
  kCount,
};
// The `op` label: "create", "session_open", "fast_path", ...
absl::string_view MetricOpName(MetricOp op);

// Why a create found no memory (the `reason` label of tensorshm_allocation_failures_total).
enum class AllocationFailure : int {
  kPool,   // the pool (or /dev/shm, or the catalog's tensor records) had no room
  kQuota,  // --session-quota, --uid-quota or --uid-tensors
  kCount,
};
absl::string_view AllocationFailureName(AllocationFailure why);

// Upper bounds (seconds) of tensorshm_acquire_wait_seconds' buckets: 1 ms to 60 s.
inline constexpr std::array<double, 15> kAcquireWaitBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

// Thread-safe. A Prometheus histogram of fixed buckets; a tiny mutex keeps a reading whole
// (its count always the sum of its buckets).
class Histogram {
 public:
  struct Reading {
    std::vector<double> bounds;    // upper bounds, ascending; +Inf is implied
    std::vector<uint64_t> counts;  // per bucket, not cumulative: bounds.size() + 1 entries
    double sum = 0;
    uint64_t count = 0;
  };

  // `bounds`: ascending upper bounds.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value) ABSL_LOCKS_EXCLUDED(mu_);
  Reading Read() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::vector<double> bounds_;
  mutable Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Thread-safe (relaxed atomics; the histograms have their own lock). Every figure starts at 0
// and only grows, except acquire_waiting.
class Metrics {
 public:
  // gRPC's canonical codes, 0 (OK) to 16 (UNAUTHENTICATED); anything else counts as UNKNOWN.
  static constexpr int kCodes = 17;

  Metrics();

  void CountOp(MetricOp op, absl::StatusCode code);
  void CountOp(MetricOp op, const absl::Status& status) { CountOp(op, status.code()); }
  // `count` more acquires that clients' fast paths served (read from their lease pages): each an
  // acquire answered OK, and counted apart as well.
  void CountFastAcquires(uint64_t count);
  // A create refused with RESOURCE_EXHAUSTED for `why`.
  void CountAllocationFailure(AllocationFailure why);
  // What a session held when it ended (its client died, or closed without releasing it):
  // `tensors` unpublished buffers of `bytes` bytes in all, freed; `leases` leases, dropped.
  void CountReclaimed(uint64_t bytes, uint64_t tensors, uint64_t leases);
  // A connection the listener closed at accept for `why` (not kNone).
  void CountConnectionRefused(ConnectionRefusal why);
  // Connections open on the daemon's socket now, as the listener last counted them.
  void SetConnections(int64_t open) { connections_.store(open, std::memory_order_relaxed); }
  // An Acquire that waited in the daemon for a publish, and ended with `code` after `waited`.
  void ObserveAcquireWait(absl::Duration waited, absl::StatusCode code);
  // Acquires waiting in the daemon now: one more (listed), one fewer (taken off the lists).
  void WaitStarted() { acquire_waiting_.fetch_add(1, std::memory_order_relaxed); }
  void WaitEnded() { acquire_waiting_.fetch_sub(1, std::memory_order_relaxed); }

  uint64_t ops(MetricOp op, int code) const {
    return ops_[static_cast<int>(op)][code].load(std::memory_order_relaxed);
  }
  uint64_t allocation_failures(AllocationFailure why) const {
    return allocation_failures_[static_cast<int>(why)].load(std::memory_order_relaxed);
  }
  uint64_t fast_acquires() const { return fast_acquires_.load(std::memory_order_relaxed); }
  uint64_t reclaimed_bytes() const { return reclaimed_bytes_.load(std::memory_order_relaxed); }
  uint64_t reclaimed_tensors() const { return reclaimed_tensors_.load(std::memory_order_relaxed); }
  uint64_t reclaimed_leases() const { return reclaimed_leases_.load(std::memory_order_relaxed); }
  int64_t acquire_waiting() const { return acquire_waiting_.load(std::memory_order_relaxed); }
  uint64_t connections_refused(ConnectionRefusal why) const {
    return connections_refused_[static_cast<int>(why)].load(std::memory_order_relaxed);
  }
  int64_t connections() const { return connections_.load(std::memory_order_relaxed); }
  Histogram::Reading acquire_wait(int code) const { return acquire_wait_[code]->Read(); }

 private:
  static int CodeIndex(absl::StatusCode code);

  std::array<std::array<std::atomic<uint64_t>, kCodes>, static_cast<int>(MetricOp::kCount)> ops_{};
  std::array<std::atomic<uint64_t>, static_cast<int>(AllocationFailure::kCount)>
      allocation_failures_{};
  std::atomic<uint64_t> fast_acquires_{0};
  std::atomic<uint64_t> reclaimed_bytes_{0};
  std::atomic<uint64_t> reclaimed_tensors_{0};
  std::atomic<uint64_t> reclaimed_leases_{0};
  std::atomic<int64_t> acquire_waiting_{0};
  std::array<std::atomic<uint64_t>, static_cast<int>(ConnectionRefusal::kCount)>
      connections_refused_{};
  std::atomic<int64_t> connections_{0};
  std::vector<std::unique_ptr<Histogram>> acquire_wait_;  // by code
};

// What the text carries besides the service's figures.
struct MetricsInfo {
  std::string version;            // tensorshm_build_info{version=...}
  double start_time_seconds = 0;  // process_start_time_seconds (Unix time)
};

// `text` as a label value between double quotes: backslash, double quote and newline escaped.
std::string EscapeLabelValue(absl::string_view text);

// The Prometheus text exposition format (0.0.4) of `stat` (the gauges, as Stat answers them)
// and `metrics`, every family with its HELP and TYPE lines. Holds no tensor name nor anything
// a client chose.
std::string RenderMetrics(const StoreFigures& stat, const Metrics& metrics,
                          const MetricsInfo& info);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_METRICS_H_
