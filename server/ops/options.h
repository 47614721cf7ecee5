// tensorshmd's command line.
#ifndef TENSORSHM_SERVER_OPS_OPTIONS_H_
#define TENSORSHM_SERVER_OPS_OPTIONS_H_

#include <sys/statvfs.h>
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/ops/eviction.h"
#include "server/ops/log.h"
#include "server/ops/shm_group.h"
#include "server/ops/uid_limits.h"

namespace tensorshm {

// --cuda-pool cuda:N=SIZE
struct CudaPoolSpec {
  int ordinal = 0;
  uint64_t bytes = 0;
};

// The per-uid limits tensorshmd applies unless told otherwise (the reasons are in options.cc).
UidLimitsConfig DefaultUidLimits();

struct DaemonOptions {
  std::string socket;                     // default: DefaultSocketPath()
  uint64_t host_pool_bytes = 1ull << 30;  // --host-pool
  uint64_t segment_bytes = 256ull << 20;  // --segment-size
  std::string shm_prefix;                 // default: "tsm-" + 64 random bits in hex
  bool memfd_segments = false;            // --segments memfd (default shm)
  std::optional<ShmGroup> shm_group;      // --shm-group; nullopt: host segments mode 0600
  uint32_t max_tensors = 4096;            // --max-tensors
  uint64_t session_quota_bytes = 0;       // --session-quota; 0: unlimited
  bool keep_segments = false;             // --keep-segments
  int64_t recovery_grace_seconds = 10;    // --recovery-grace
  std::set<uid_t> allow_uids;             // --allow-uid, repeatable
  std::set<gid_t> allow_gids;             // --allow-gid, repeatable
  std::vector<CudaPoolSpec> cuda_pools;   // --cuda-pool, repeatable
  uint64_t cuda_segment_bytes = 0;        // --cuda-segment-size; 0: min(pool, 1Gi)
  std::string cuda_pool_kind = "auto";    // --cuda-pool-kind: auto, vmm or ipc
  LogLevel log_level = LogLevel::kInfo;
  std::string metrics;                     // --metrics HOST:PORT (ParseMetricsAddress); empty: off
  EvictPolicy evict = EvictPolicy::kNone;  // --evict none|lru
  bool help = false;
  bool version = false;     // --version: print it and exit
  std::string config_file;  // --config; empty: none
  // --uid-sessions, --uid-leases, --uid-waiters, --uid-quota, --uid-tensors (its default set by
  // ParseOptions: FairTensorShare); 0 in a field: no limit
  UidLimitsConfig uid_limits = DefaultUidLimits();
  // --uid-connections: most connections one uid (the daemon's own aside) may have open on the
  // socket at once; 0: no limit. Unset: DefaultUidConnections(uid_limits.sessions).
  std::optional<uint64_t> uid_connections;
};

// The --uid-connections a daemon with --uid-sessions `sessions` has unless told: two connections
// per session (gRPC and the memory channel) and 64 for tools and reconnects; 0 (no limit) if
// `sessions` is 0.
uint64_t DefaultUidConnections(uint64_t sessions);

// The largest size a flag takes (4 EiB): rounding it up to a page, or adding the catalog's size
// to it, never wraps, and it fits an off_t.
inline constexpr uint64_t kMaxSizeBytes = uint64_t{1} << 62;

// Parses "64Mi", "1G", "2Ki", "4096B" (K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024, B is
// bytes; "MiB", "GB" and the like also do), at most kMaxSizeBytes. A number without a unit is
// refused ("0" aside): "1024" was once bytes where "1024Mi" was meant. INVALID_ARGUMENT naming
// `flag`, the text and the units otherwise.
absl::StatusOr<uint64_t> ParseSize(absl::string_view text, absl::string_view flag);

// Whether /dev/shm (`shm`, as statvfs reports it) can hold a pool of `pool_bytes` and a catalog
// of `control_bytes`, computed without wrapping. FAILED_PRECONDITION naming --host-pool, the
// sizes and the fix if its total size cannot; OK otherwise, with `*warning` set if it has less
// free now (creates then fail cleanly when it runs out).
absl::Status CheckShmCapacity(uint64_t pool_bytes, uint64_t control_bytes,
                              const struct statvfs& shm, std::string* warning);

// Parses a --cuda-pool value, "cuda:N=SIZE"; the size is rounded up to 256 bytes.
absl::StatusOr<CudaPoolSpec> ParseCudaPool(absl::string_view text);

// Parses an --evict value: "none" or "lru".
absl::StatusOr<EvictPolicy> ParseEvictPolicy(absl::string_view text);

// How a flag takes its value: a switch (--keep-segments; `key = true` in a --config file), one
// value (the last one given counts), or one value per use, all kept (--allow-uid).
enum class FlagKind { kSwitch, kValue, kRepeated };

struct FlagSpec {
  std::string name;  // the long name without "--", also its key in a --config file
  FlagKind kind;
  std::string value_name;  // for --help: "SIZE", "PATH", ...
  std::string help;
};

// Every flag tensorshmd takes, --config and --help aside, in the order --help lists them.
const std::vector<FlagSpec>& DaemonFlags();

// Flags as given, by name without "--": each value as text (a switch: "true" or "false").
using FlagValues = std::map<std::string, std::vector<std::string>>;

// Parses argv (with CLI11), reading the --config file if one is named: the file's flags apply
// first, the command line's over them. INVALID_ARGUMENT naming the flag (or the file and key)
// and the value for anything unknown or malformed.
absl::StatusOr<DaemonOptions> ParseOptions(int argc, char** argv);

// The --help text.
std::string Usage();

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_OPTIONS_H_
