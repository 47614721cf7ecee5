#include "server/ops/metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/tensor/layout.h"

namespace tensorshm {

absl::string_view MetricOpName(MetricOp op) {
  switch (op) {
    case MetricOp::kCreate:
      return "create";
    case MetricOp::kPublish:
      return "publish";
    case MetricOp::kAcquire:
      return "acquire";
    case MetricOp::kDelete:
      return "delete";
    case MetricOp::kList:
      return "list";
    case MetricOp::kStat:
      return "stat";
    case MetricOp::kSessionOpen:
      return "session_open";
    case MetricOp::kRelease:
      return "release";
    case MetricOp::kBind:
      return "bind";
    case MetricOp::kSegment:
      return "segment";
    case MetricOp::kFastPath:
      return "fast_path";
    case MetricOp::kUnknown:
    case MetricOp::kCount:
      break;
  }
  return "unknown";
}

absl::string_view AllocationFailureName(AllocationFailure why) {
  return why == AllocationFailure::kQuota ? "quota" : "pool";
}

absl::string_view ConnectionRefusalName(ConnectionRefusal why) {
  switch (why) {
    case ConnectionRefusal::kNotAdmitted:
      return "not_admitted";
    case ConnectionRefusal::kUidLimit:
      return "uid_limit";
    default:
      return "daemon_limit";
  }
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  // The first bucket whose upper bound holds the value ("le": less or equal); +Inf otherwise.
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

Histogram::Reading Histogram::Read() const {
  Reading reading;
  reading.bounds = bounds_;
  MutexLock lock(&mu_);
  reading.counts = counts_;
  reading.sum = sum_;
  reading.count = count_;
  return reading;
}

Metrics::Metrics() {
  for (int code = 0; code < kCodes; ++code) {
    acquire_wait_.push_back(std::make_unique<Histogram>(
        std::vector<double>(kAcquireWaitBuckets.begin(), kAcquireWaitBuckets.end())));
  }
}

int Metrics::CodeIndex(absl::StatusCode code) {
  const int index = static_cast<int>(code);
  return index >= 0 && index < kCodes ? index : static_cast<int>(absl::StatusCode::kUnknown);
}

void Metrics::CountOp(MetricOp op, absl::StatusCode code) {
  ops_[static_cast<int>(op)][CodeIndex(code)].fetch_add(1, std::memory_order_relaxed);
}

void Metrics::CountFastAcquires(uint64_t count) {
  ops_[static_cast<int>(MetricOp::kAcquire)][static_cast<int>(absl::StatusCode::kOk)].fetch_add(
      count, std::memory_order_relaxed);
  fast_acquires_.fetch_add(count, std::memory_order_relaxed);
}

void Metrics::CountAllocationFailure(AllocationFailure why) {
  allocation_failures_[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
}

void Metrics::CountConnectionRefused(ConnectionRefusal why) {
  if (why == ConnectionRefusal::kNone || why == ConnectionRefusal::kCount) return;
  connections_refused_[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
}

void Metrics::CountReclaimed(uint64_t bytes, uint64_t tensors, uint64_t leases) {
  reclaimed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  reclaimed_tensors_.fetch_add(tensors, std::memory_order_relaxed);
  reclaimed_leases_.fetch_add(leases, std::memory_order_relaxed);
}

void Metrics::ObserveAcquireWait(absl::Duration waited, absl::StatusCode code) {
  acquire_wait_[CodeIndex(code)]->Observe(absl::ToDoubleSeconds(waited));
}

std::string EscapeLabelValue(absl::string_view text) {
  std::string escaped;
  escaped.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '\\':
        escaped += "\\\\";
        break;
      case '"':
        escaped += "\\\"";
        break;
      case '\n':
        escaped += "\\n";
        break;
      default:
        escaped += c;
    }
  }
  return escaped;
}

namespace {

std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// A sample value: integers as they are, others with enough digits to read back.
std::string Value(uint64_t value) { return absl::StrCat(value); }
std::string Value(int64_t value) { return absl::StrCat(value); }
std::string Value(double value) { return absl::StrFormat("%.17g", value); }

class Writer {
 public:
  // The HELP and TYPE lines of family `name`.
  void Family(absl::string_view name, absl::string_view type, absl::string_view help) {
    absl::StrAppend(&text_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  // One sample; `labels` as name, value pairs.
  template <typename T>
  void Sample(absl::string_view name,
              std::initializer_list<std::pair<absl::string_view, std::string>> labels, T value) {
    absl::StrAppend(&text_, name);
    if (labels.size() > 0) {
      text_ += '{';
      bool first = true;
      for (const auto& [label, label_value] : labels) {
        absl::StrAppend(&text_, first ? "" : ",", label, "=\"", EscapeLabelValue(label_value),
                        "\"");
        first = false;
      }
      text_ += '}';
    }
    absl::StrAppend(&text_, " ", Value(value), "\n");
  }
  std::string Take() { return std::move(text_); }

 private:
  std::string text_;
};

// The `le` label of a bucket's upper bound: "0.001", "2.5", "60".
std::string Bound(double bound) { return absl::StrFormat("%g", bound); }

}  // namespace

std::string RenderMetrics(const StoreFigures& stat, const Metrics& metrics,
                          const MetricsInfo& info) {
  Writer out;
  out.Family("tensorshm_build_info", "gauge", "tensorshmd's version, as a label; the value is 1.");
  out.Sample("tensorshm_build_info", {{"version", info.version}}, int64_t{1});
  out.Family("process_start_time_seconds", "gauge",
             "When tensorshmd started, in seconds since the Unix epoch.");
  out.Sample("process_start_time_seconds", {}, info.start_time_seconds);

  // ---- Gauges: what Stat answers, read the way Stat reads it ----
  out.Family("tensorshm_pool_capacity_bytes", "gauge",
             "Most memory the pool of a device may hold (--host-pool, --cuda-pool).");
  for (const PoolFigures& pool : stat.pools) {
    out.Sample("tensorshm_pool_capacity_bytes", {{"device", DeviceName(pool.device)}},
               pool.capacity_bytes);
  }
  out.Family("tensorshm_pool_used_bytes", "gauge",
             "Bytes of the pool of a device that tensors (published or not) take; stocked "
             "buffers are tensorshm_pool_stock_bytes.");
  for (const PoolFigures& pool : stat.pools) {
    out.Sample("tensorshm_pool_used_bytes", {{"device", DeviceName(pool.device)}}, pool.used_bytes);
  }
  out.Family("tensorshm_pool_stock_bytes", "gauge",
             "Bytes of the pool of a device that stocked buffers take: made ahead of a "
             "producer's need, stock until published.");
  for (const PoolFigures& pool : stat.pools) {
    out.Sample("tensorshm_pool_stock_bytes", {{"device", DeviceName(pool.device)}},
               pool.stock_bytes);
  }
  out.Family("tensorshm_pool_largest_free_bytes", "gauge",
             "The largest tensor the pool of a device could take now (uids' fair shares aside): "
             "its largest free block, or the room for a new segment.");
  for (const PoolFigures& pool : stat.pools) {
    out.Sample("tensorshm_pool_largest_free_bytes", {{"device", DeviceName(pool.device)}},
               pool.largest_free_bytes);
  }
  out.Family("tensorshm_pool_segments", "gauge",
             "Segments (shm objects, memfds or cuMemAlloc blocks) the pool of a device is made "
             "of.");
  for (const PoolFigures& pool : stat.pools) {
    out.Sample("tensorshm_pool_segments", {{"device", DeviceName(pool.device)}}, pool.segments);
  }
  out.Family("tensorshm_tensors", "gauge",
             "Tensors holding memory: published, unpublished, or unbound but still leased.");
  out.Sample("tensorshm_tensors", {}, stat.tensors);
  out.Family("tensorshm_stocked_tensors", "gauge",
             "Of tensorshm_tensors, the stocked buffers (unpublished, made ahead of need).");
  out.Sample("tensorshm_stocked_tensors", {}, stat.stocked_tensors);
  out.Family("tensorshm_names", "gauge", "Names bound to a published tensor.");
  out.Sample("tensorshm_names", {}, stat.names);
  out.Family("tensorshm_leases", "gauge",
             "Leases held: through the daemon, and in the fast path's lease pages.");
  out.Sample("tensorshm_leases", {}, stat.leases);
  out.Family("tensorshm_sessions", "gauge", "Client sessions open.");
  out.Sample("tensorshm_sessions", {}, stat.sessions);
  out.Family("tensorshm_creates_waiting", "gauge",
             "Creates waiting in the daemon for memory to be freed (CreateRequest.wait_ms).");
  out.Sample("tensorshm_creates_waiting", {}, stat.creates_waiting);
  out.Family("tensorshm_evicted_tensors_total", "counter",
             "Published tensors nobody leased that --evict lru evicted to make room for creates.");
  out.Sample("tensorshm_evicted_tensors_total", {}, stat.evicted_tensors);
  out.Family("tensorshm_evicted_bytes_total", "counter",
             "Bytes of the tensors --evict lru evicted.");
  out.Sample("tensorshm_evicted_bytes_total", {}, stat.evicted_bytes);

  // ---- What the service counted ----
  out.Family("tensorshm_acquire_waiting", "gauge",
             "Acquire calls waiting in the daemon for a publish now (waits in a client's fast "
             "path are not seen).");
  out.Sample("tensorshm_acquire_waiting", {}, metrics.acquire_waiting());

  out.Family("tensorshm_operations_total", "counter",
             "Requests answered, by operation and gRPC status code: gRPC calls and memory "
             "channel requests alike. op=\"acquire\",code=\"OK\" includes the acquires a "
             "client's fast path served from shared memory (host tensors; counted in its lease "
             "page, read by the daemon); the fast path's misses (NOT_FOUND) and waits are not "
             "seen.");
  for (int op = 0; op < static_cast<int>(MetricOp::kCount); ++op) {
    for (int code = 0; code < Metrics::kCodes; ++code) {
      const uint64_t count = metrics.ops(static_cast<MetricOp>(op), code);
      // OK is always there (from 0), so that rates start at the first scrape.
      if (count == 0 && (code != 0 || static_cast<MetricOp>(op) == MetricOp::kUnknown)) continue;
      out.Sample(
          "tensorshm_operations_total",
          {{"op", std::string(MetricOpName(static_cast<MetricOp>(op)))}, {"code", CodeName(code)}},
          count);
    }
  }
  out.Family("tensorshm_fast_path_acquires_total", "counter",
             "Of the acquires in tensorshm_operations_total{op=\"acquire\",code=\"OK\"}, those "
             "clients' fast paths served from shared memory, as their lease pages count them.");
  out.Sample("tensorshm_fast_path_acquires_total", {}, metrics.fast_acquires());
  out.Family("tensorshm_allocation_failures_total", "counter",
             "Creates refused with RESOURCE_EXHAUSTED: reason=\"pool\" when the pool (or "
             "/dev/shm, or the catalog's --max-tensors records) had no room, \"quota\" when "
             "--session-quota, --uid-quota or --uid-tensors refused it.");
  for (int why = 0; why < static_cast<int>(AllocationFailure::kCount); ++why) {
    out.Sample(
        "tensorshm_allocation_failures_total",
        {{"reason", std::string(AllocationFailureName(static_cast<AllocationFailure>(why)))}},
        metrics.allocation_failures(static_cast<AllocationFailure>(why)));
  }
  out.Family("tensorshm_reclaimed_bytes_total", "counter",
             "Bytes of unpublished buffers freed because their session ended holding them: the "
             "client died, or disconnected without publishing or dropping them (a client's "
             "unused stocked buffers included).");
  out.Sample("tensorshm_reclaimed_bytes_total", {}, metrics.reclaimed_bytes());
  out.Family("tensorshm_reclaimed_tensors_total", "counter",
             "Unpublished buffers freed because their session ended holding them.");
  out.Sample("tensorshm_reclaimed_tensors_total", {}, metrics.reclaimed_tensors());
  out.Family("tensorshm_reclaimed_leases_total", "counter",
             "Leases (through the daemon, and lease page slots) dropped because their session "
             "ended holding them: the client died, or disconnected without releasing them.");
  out.Sample("tensorshm_reclaimed_leases_total", {}, metrics.reclaimed_leases());

  out.Family("tensorshm_connections", "gauge",
             "Connections open on the daemon's socket (gRPC and memory channel, each client has "
             "two), as the listener last counted them (closed ones are noticed within seconds).");
  out.Sample("tensorshm_connections", {}, metrics.connections());
  out.Family("tensorshm_connections_refused_total", "counter",
             "Connections closed as soon as they were accepted: reason=\"not_admitted\" (a uid "
             "--allow-uid / --allow-gid do not admit), \"uid_limit\" (past --uid-connections), "
             "\"daemon_limit\" (past the daemon-wide limit its open file limit sets).");
  for (int why = static_cast<int>(ConnectionRefusal::kNotAdmitted);
       why < static_cast<int>(ConnectionRefusal::kCount); ++why) {
    out.Sample(
        "tensorshm_connections_refused_total",
        {{"reason", std::string(ConnectionRefusalName(static_cast<ConnectionRefusal>(why)))}},
        metrics.connections_refused(static_cast<ConnectionRefusal>(why)));
  }

  out.Family("tensorshm_acquire_wait_seconds", "histogram",
             "How long Acquire calls that waited in the daemon for a publish waited, by how the "
             "wait ended: code=\"OK\" (woken by the publish), DEADLINE_EXCEEDED, CANCELLED, "
             "FAILED_PRECONDITION (session ended), UNAVAILABLE (daemon stopping), or a refusal "
             "at the publish. Acquires answered at once are not observed, nor waits in a "
             "client's fast path (host tensors).");
  for (int code = 0; code < Metrics::kCodes; ++code) {
    const Histogram::Reading reading = metrics.acquire_wait(code);
    if (reading.count == 0 && code != 0) continue;
    const std::string code_name = CodeName(code);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < reading.bounds.size(); ++i) {
      cumulative += reading.counts[i];
      out.Sample("tensorshm_acquire_wait_seconds_bucket",
                 {{"code", code_name}, {"le", Bound(reading.bounds[i])}}, cumulative);
    }
    cumulative += reading.counts.back();
    out.Sample("tensorshm_acquire_wait_seconds_bucket", {{"code", code_name}, {"le", "+Inf"}},
               cumulative);
    out.Sample("tensorshm_acquire_wait_seconds_sum", {{"code", code_name}}, reading.sum);
    out.Sample("tensorshm_acquire_wait_seconds_count", {{"code", code_name}}, reading.count);
  }
  return out.Take();
}

}  // namespace tensorshm
