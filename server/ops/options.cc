#include "server/ops/options.h"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <random>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/check.h"
#include "common/base/socket_path.h"
#include "server/ops/config_file.h"
#include "server/ops/metrics_http.h"

namespace tensorshm {
namespace {

bool IsPrefixChar(char c) { return absl::ascii_isalnum(c) || c == '-' || c == '_'; }

std::string RandomPrefix() {
  std::random_device device;
  return absl::StrFormat("tsm-%08x%08x", device(), device());
}

// A per-uid count: a whole number, 0 meaning no limit.
absl::StatusOr<uint64_t> ParseCount(absl::string_view text, absl::string_view flag) {
  uint64_t value;
  if (text.empty() || !absl::ascii_isdigit(text[0]) || !absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " = \"", text, "\": expected a whole number >= 0 (0: no limit)"));
  }
  return value;
}

}  // namespace

// Each limit is far above what one user's programs hold, and low enough that one uid among
// several admitted ones cannot take the daemon's memory or threads from the others:
//
// - sessions 1024: a session is a client process (or a Client in one), with a stream, a lease
//   page (4 KiB of shared memory), a memory channel connection and, until the service uses the
//   callback API, a gRPC thread. A training job with a few hundred data loader processes stays
//   far below; 1024 caps one uid's threads, descriptors and lease pages.
// - leases 262144 (2^18): an RPC lease costs the daemon about 64 bytes (a map entry in its
//   session), so a uid at the limit holds about 16 MiB. Most acquires of host tensors take a
//   lease page slot instead (504 per session, bounded by the session limit); RPC leases are
//   CUDA tensors and the fallback, and a program holding a quarter of a million of them at once
//   is not a plausible single user. A reconnecting client's held_tensor_ids list is bounded by
//   the same number.
// - waiters 32768: a waiting Acquire is a pending call in the daemon (a thread under the sync
//   API, a few KiB once waiters are callbacks). The load test runs 20,000 at once; 32768 leaves
//   room above it and still bounds one uid's waiting calls.
// - unpublished bytes (--uid-quota) 0, no limit beyond the pool: the pool (--host-pool,
//   --cuda-pool) already bounds the memory, and a single user must be able to create one tensor
//   as large as the pool. A daemon shared between uids should set --uid-quota (for example the
//   pool divided by the number of uids), as the pool is otherwise first come, first served.
// - tensor records (--uid-tensors): not set here, as the default depends on other flags:
//   ParseOptions gives each admitted uid an even share of --max-tensors (FairTensorShare). A
//   record costs a zero-byte tensor nothing but the record, so without a count per uid one
//   admitted uid could take them all and leave every other uid's create refused; the shares add
//   up to the catalog, so none can. Alone (no --allow-uid) the daemon's uid has the whole catalog.
UidLimitsConfig DefaultUidLimits() {
  UidLimitsConfig limits;
  limits.sessions = 1024;
  limits.leases = 1u << 18;
  limits.waiters = 32768;
  limits.unpublished_bytes = 0;
  return limits;
}

// Connections (--uid-connections): every client holds two (gRPC and the memory channel), and a
// connection is a descriptor of the daemon's, whose number is bounded (RLIMIT_NOFILE). The
// default follows --uid-sessions, so that a uid can open every session it is allowed, with room
// for tensorshmctl, health probes and clients reconnecting while their old connections close.
// The daemon's own uid is not held to it (see ConnectionLimits): it is bounded only by the
// daemon-wide limit, of which a part is kept for it alone.
uint64_t DefaultUidConnections(uint64_t sessions) { return sessions == 0 ? 0 : 2 * sessions + 64; }

namespace {

// What CLI11 parses a command line into: the App that BuildApp makes writes here.
struct CommandLine {
  // One per flag, in DaemonFlags order, each holding what CLI11 parsed for it: made at full
  // size before the App binds to its members.
  struct Binding {
    std::vector<std::string> values;
    bool on = false;  // a switch
  };
  std::vector<Binding> flags{DaemonFlags().size()};
  std::string config;
  bool help = false;
  bool version = false;
};

constexpr size_t kHelpColumn = 26;

// --help as Unix tools write it: the usage line first, then what the program does.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* app, std::string name) const override {
    return absl::StrCat("usage: ", name, " [options]\n\n", app->get_description(), "\n");
  }
  std::string make_description(const CLI::App*) const override { return ""; }
};

std::unique_ptr<CLI::App> BuildApp(CommandLine* line) {
  auto app = std::make_unique<CLI::App>(
      "Shares tensors between processes through shared memory; clients talk to it over gRPC on\n"
      "a Unix socket.",
      "tensorshmd");
  app->set_help_flag();  // --help is an ordinary flag here: ParseOptions reports it
  app->allow_extras();   // unknown arguments are reported by ParseOptions, with their name
  auto formatter = std::make_shared<HelpFormatter>();
  formatter->column_width(kHelpColumn);
  app->formatter(formatter);
  const std::vector<FlagSpec>& flags = DaemonFlags();
  for (size_t i = 0; i < flags.size(); ++i) {
    const FlagSpec& flag = flags[i];
    const std::string name = absl::StrCat("--", flag.name);
    if (flag.kind == FlagKind::kSwitch) {
      app->add_flag(name, line->flags[i].on, flag.help);
      continue;
    }
    CLI::Option* option = app->add_option(name, line->flags[i].values, flag.help)
                              ->type_name(flag.value_name)
                              ->expected(1)
                              ->allow_extra_args(false);
    // A value flag given twice takes the last; a repeatable one takes every one.
    option->multi_option_policy(flag.kind == FlagKind::kRepeated
                                    ? CLI::MultiOptionPolicy::TakeAll
                                    : CLI::MultiOptionPolicy::TakeLast);
  }
  app->add_option("--config", line->config,
                  "read flags from a TOML file whose keys are the long flag names\n"
                  "(host-pool = \"4Gi\", keep-segments = true, allow-uid = [1000]);\n"
                  "flags given on the command line override the file's")
      ->type_name("FILE");
  app->add_flag("-h,--help", line->help, "this text");
  app->add_flag("--version", line->version, "print tensorshmd's version and exit");
  app->footer(
      "Sizes need a unit: B (bytes), K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of\n"
      "1024), e.g. 64Mi, 4Gi, 4096B; a bare number (0 aside) is refused.\n"
      "SIGTERM or SIGINT stops serving, closes sessions, removes the socket and the shm\n"
      "segments (unless --keep-segments), and exits 0. Started with the --shm-prefix of a daemon\n"
      "that was killed (or kept its segments), tensorshmd re-opens its segments and serves\n"
      "every published tensor again; tensorshmctl leftovers lists (and --remove removes) the\n"
      "segments of killed daemons nobody restarted.");
  return app;
}

// Sets the field of `options` that `--flag` (a name from DaemonFlags) names from `value`.
// INVALID_ARGUMENT naming the flag and the value if the value is not one it takes.
absl::Status ApplyFlag(absl::string_view flag, absl::string_view value, DaemonOptions& options) {
  const std::string arg = absl::StrCat("--", flag);
  if (arg == "--keep-segments") {
    options.keep_segments = value == "true";
  } else if (arg == "--socket") {
    if (value.empty()) return absl::InvalidArgumentError("--socket = \"\": must not be empty");
    options.socket = std::string(value);
  } else if (arg == "--host-pool") {
    absl::StatusOr<uint64_t> size = ParseSize(value, arg);
    if (!size.ok()) return size.status();
    options.host_pool_bytes = *size;
  } else if (arg == "--cuda-pool") {
    absl::StatusOr<CudaPoolSpec> pool = ParseCudaPool(value);
    if (!pool.ok()) return pool.status();
    for (const CudaPoolSpec& other : options.cuda_pools) {
      if (other.ordinal == pool->ordinal) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--cuda-pool = \"", value, "\": cuda:", pool->ordinal, " has a pool already"));
      }
    }
    options.cuda_pools.push_back(*pool);
  } else if (arg == "--segments") {
    if (value == "shm") {
      options.memfd_segments = false;
    } else if (value == "memfd") {
      options.memfd_segments = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--segments = \"", value, "\": expected shm or memfd"));
    }
  } else if (arg == "--cuda-segment-size") {
    absl::StatusOr<uint64_t> size = ParseSize(value, arg);
    if (!size.ok()) return size.status();
    if (*size == 0) return absl::InvalidArgumentError("--cuda-segment-size = 0: must be positive");
    options.cuda_segment_bytes = *size;
  } else if (arg == "--cuda-pool-kind") {
    if (value != "auto" && value != "vmm" && value != "ipc") {
      return absl::InvalidArgumentError(
          absl::StrCat("--cuda-pool-kind = \"", value, "\": expected auto, vmm or ipc"));
    }
    options.cuda_pool_kind = std::string(value);
  } else if (arg == "--recovery-grace") {
    if (!absl::SimpleAtoi(value, &options.recovery_grace_seconds) ||
        options.recovery_grace_seconds < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--recovery-grace = \"", value, "\": expected seconds >= 0"));
    }
  } else if (arg == "--allow-uid") {
    uint32_t id;
    if (!absl::SimpleAtoi(value, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(arg, " = \"", value, "\": expected a numeric uid"));
    }
    options.allow_uids.insert(id);
  } else if (arg == "--allow-gid") {
    // A group name (the packaged config's "tensorshm") or a number, as --shm-group.
    absl::StatusOr<ShmGroup> group = ParseGroup(arg, value);
    if (!group.ok()) return group.status();
    options.allow_gids.insert(group->gid);
  } else if (arg == "--session-quota") {
    absl::StatusOr<uint64_t> size = ParseSize(value, arg);
    if (!size.ok()) return size.status();
    options.session_quota_bytes = *size;
  } else if (arg == "--uid-sessions" || arg == "--uid-leases" || arg == "--uid-waiters") {
    absl::StatusOr<uint64_t> count = ParseCount(value, arg);
    if (!count.ok()) return count.status();
    (arg == "--uid-sessions" ? options.uid_limits.sessions
     : arg == "--uid-leases" ? options.uid_limits.leases
                             : options.uid_limits.waiters) = *count;
  } else if (arg == "--uid-connections") {
    absl::StatusOr<uint64_t> count = ParseCount(value, arg);
    if (!count.ok()) return count.status();
    options.uid_connections = *count;
  } else if (arg == "--uid-quota") {
    absl::StatusOr<uint64_t> size = ParseSize(value, arg);
    if (!size.ok()) return size.status();
    options.uid_limits.unpublished_bytes = *size;
  } else if (arg == "--uid-tensors") {
    absl::StatusOr<uint64_t> count = ParseCount(value, arg);
    if (!count.ok()) return count.status();
    options.uid_limits.tensors = *count;
  } else if (arg == "--segment-size") {
    absl::StatusOr<uint64_t> size = ParseSize(value, arg);
    if (!size.ok()) return size.status();
    options.segment_bytes = *size;
  } else if (arg == "--shm-group") {
    absl::StatusOr<ShmGroup> group = ParseShmGroup(value);
    if (!group.ok()) return group.status();
    options.shm_group = *std::move(group);
  } else if (arg == "--shm-prefix") {
    if (value.empty() || value.size() > 48 ||
        !std::all_of(value.begin(), value.end(), IsPrefixChar)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shm-prefix = \"", value, "\": use 1-48 characters of [A-Za-z0-9_-]"));
    }
    options.shm_prefix = std::string(value);
  } else if (arg == "--max-tensors") {
    if (!absl::SimpleAtoi(value, &options.max_tensors) || options.max_tensors == 0 ||
        options.max_tensors > (1u << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--max-tensors = \"", value, "\": expected 1..16777216"));
    }
  } else if (arg == "--metrics") {
    if (absl::Status s = ParseMetricsAddress(value).status(); !s.ok()) return s;
    options.metrics = std::string(value);
  } else if (arg == "--evict") {
    absl::StatusOr<EvictPolicy> policy = ParseEvictPolicy(value);
    if (!policy.ok()) return policy.status();
    options.evict = *policy;
  } else if (arg == "--log-level") {
    absl::StatusOr<LogLevel> level = ParseLogLevel(value);
    if (!level.ok()) return level.status();
    options.log_level = *level;
  } else {
    TSM_CHECK(false && "a flag of DaemonFlags() that ApplyFlag does not know");
  }
  return absl::OkStatus();
}

// The command line's flags, by name; INVALID_ARGUMENT naming the argument CLI11 refused.
absl::StatusOr<FlagValues> ParseCommandLine(int argc, char** argv, std::string* config, bool* help,
                                            bool* version) {
  CommandLine line;
  std::unique_ptr<CLI::App> app = BuildApp(&line);
  try {
    app->parse(argc, argv);
  } catch (const CLI::ArgumentMismatch& e) {
    // "--flag: 1 required SIZE missing", for a flag that ends the command line.
    const std::string what = e.what();
    return absl::InvalidArgumentError(
        absl::StrCat(what.substr(0, what.find(':')), ": needs a value"));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat(e.what(), " (see tensorshmd --help)"));
  }
  if (std::vector<std::string> extras = app->remaining(); !extras.empty()) {
    const std::string& arg = extras.front();
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown option \"", arg.substr(0, arg.find('=')), "\" (see tensorshmd --help)"));
  }
  const std::vector<FlagSpec>& flags = DaemonFlags();
  FlagValues values;
  for (size_t i = 0; i < flags.size(); ++i) {
    const std::string name = absl::StrCat("--", flags[i].name);
    if (app->get_option(name)->count() == 0) continue;
    values[flags[i].name] = flags[i].kind == FlagKind::kSwitch
                                ? std::vector<std::string>{line.flags[i].on ? "true" : "false"}
                                : line.flags[i].values;
  }
  *config = line.config;
  *help = line.help;
  *version = line.version;
  return values;
}

}  // namespace

std::string Usage() {
  CommandLine line;
  return BuildApp(&line)->help();
}

absl::StatusOr<DaemonOptions> ParseOptions(int argc, char** argv) {
  DaemonOptions options;
  options.socket = DefaultSocketPath();
  std::string config;
  absl::StatusOr<FlagValues> command_line =
      ParseCommandLine(argc, argv, &config, &options.help, &options.version);
  if (!command_line.ok()) return command_line.status();
  if (options.help || options.version) return options;
  // The file's flags first, then the command line's over them (a repeatable flag given on the
  // command line replaces the file's list).
  FlagValues values;
  if (!config.empty()) {
    absl::StatusOr<FlagValues> file = ReadConfigFile(config);
    if (!file.ok()) return file.status();
    values = *std::move(file);
    options.config_file = config;
  }
  for (auto& [name, given] : *command_line) values[name] = std::move(given);
  for (const FlagSpec& flag : DaemonFlags()) {
    auto it = values.find(flag.name);
    if (it == values.end()) continue;
    for (const std::string& value : it->second) {
      absl::Status status = ApplyFlag(flag.name, value, options);
      if (!status.ok() && !command_line->contains(flag.name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--config ", config, ": ", status.message()));
      }
      if (!status.ok()) return status;
    }
  }
  if (options.memfd_segments && options.keep_segments) {
    return absl::InvalidArgumentError(
        "--keep-segments with --segments memfd: memfd segments cannot outlive the daemon");
  }
  if (options.memfd_segments && options.shm_group) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shm-group = \"", options.shm_group->name,
        "\" with --segments memfd: memfd segments have no name, so a server that opens "
        "segments by name (Triton's system shared memory) cannot use them; use --segments shm "
        "(the default)"));
  }
  if (!options.uid_connections) {
    options.uid_connections = DefaultUidConnections(options.uid_limits.sessions);
  }
  if (!values.contains("uid-tensors")) {
    options.uid_limits.tensors =
        FairTensorShare(options.max_tensors, static_cast<uint32_t>(geteuid()),
                        std::set<uint32_t>(options.allow_uids.begin(), options.allow_uids.end()),
                        options.allow_gids.size());
  }
  if (options.shm_prefix.empty()) options.shm_prefix = RandomPrefix();
  // Both sizes round to whole pages, the unit of allocation.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t* size : {&options.host_pool_bytes, &options.segment_bytes}) {
    if (*size == 0) {
      return absl::InvalidArgumentError(size == &options.host_pool_bytes
                                            ? "--host-pool = 0: must be positive"
                                            : "--segment-size = 0: must be positive");
    }
    *size = (*size + page - 1) / page * page;
  }
  return options;
}

}  // namespace tensorshm
