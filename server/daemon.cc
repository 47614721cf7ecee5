// Daemon (server/daemon.h): start, serve, stop.
#include "server/daemon.h"

#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_posix.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/base/unique_fd.h"
#include "common/cuda/cuda_driver.h"
#include "server/catalog/catalog.h"
#include "server/memory/cuda_pool.h"
#include "server/ops/log.h"
#include "server/ops/metrics.h"
#include "server/ops/socket_dir.h"
#include "server/rpc/channel_handler.h"

namespace tensorshm {
namespace {

// FAILED_PRECONDITION, with the sizes and the fix, if /dev/shm cannot hold the pool and the
// catalog at all; a warning if it has less free now (creates then fail cleanly when it runs out).
absl::Status CheckDevShm(uint64_t pool_bytes, uint64_t control_bytes) {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) {
    TSM_LOG(kWarning) << "cannot check the size of /dev/shm: " << std::strerror(errno);
    return absl::OkStatus();
  }
  std::string warning;
  absl::Status status = CheckShmCapacity(pool_bytes, control_bytes, st, &warning);
  if (!warning.empty()) {
    TSM_LOG(kWarning) << warning;
  }
  return status;
}

std::string FormatBytes(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.4g %s", value, kUnits[unit]);
}

// Takes the lock on `prefix` (common/base/prefix_lock.h) and records this daemon in it. A holder
// that is starting or stopping (or tensorshmctl removing leftovers) gets a second to let go;
// FAILED_PRECONDITION naming the prefix and the holder if it is still held then.
absl::StatusOr<PrefixLock> HoldPrefix(const std::string& prefix, const std::string& socket) {
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  absl::StatusOr<PrefixLock> lock = PrefixLock::Take(prefix, /*create=*/true, geteuid());
  while (absl::IsUnavailable(lock.status()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    lock = PrefixLock::Take(prefix, /*create=*/true, geteuid());
  }
  if (absl::IsUnavailable(lock.status())) {
    absl::StatusOr<PrefixHolder> holder = ReadPrefixHolder(prefix);
    return absl::FailedPreconditionError(absl::StrCat(
        "--shm-prefix ", prefix, ": in use by ",
        holder.ok() ? DescribeHolder(*holder) : "another process", ", which holds ",
        PrefixLockPath(prefix),
        "; one daemon serves a prefix at a time: stop that daemon first to take its tensors "
        "over, or give this one another --shm-prefix (or none, for a random one)"));
  }
  if (!lock.ok()) return lock.status();
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  // The record is for people (the lock is the flock): a /dev/shm too full for it is no reason
  // not to serve.
  if (absl::Status s = lock->Record(PrefixHolder{getpid(), host, socket, "serving"}); !s.ok()) {
    TSM_LOG(kWarning) << "cannot record this daemon in its prefix's lock file: " << s.message();
  }
  return lock;
}

// Threads for gRPC's synchronous services (reflection); the callback service needs none.
constexpr int kSyncServerThreads = 4;

// A random, non-zero id for this daemon start (SessionOpened.instance_id).
uint64_t NewInstanceId() {
  std::random_device random;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{random()} << 32) ^ random();
  return id;
}

// Every segment is a descriptor held by the daemon, and every client two connections: the soft
// limit of open files (often 1024) goes up to the hard one.
void RaiseOpenFileLimit() {
  rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      TSM_LOG(kWarning) << "cannot raise the open file limit: " << std::strerror(errno);
    }
  }
}

// Who the listener lets in: the admitted uids (`policy`), each but the owner held to
// --uid-connections, all together to what the open file limit leaves room for; of other uids, a
// few connections each, only to be answered PERMISSION_DENIED.
AcceptPolicy MakeAcceptPolicy(const AccessPolicy& policy, uint64_t uid_connections,
                              Metrics* metrics) {
  rlimit files{};
  uint64_t open_files = 1024;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    open_files = files.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : files.rlim_cur;
  }
  AcceptPolicy accept;
  accept.admit = [&policy](const PeerCredentials& peer) { return policy.Admit(peer); };
  accept.needs_groups = policy.admits_groups();
  accept.limits.owner = policy.owner();
  accept.limits.per_uid = uid_connections;
  accept.limits.total = DaemonConnectionLimit(open_files, &accept.limits.owner_reserve);
  accept.limits.stranger_per_uid = kStrangerConnectionsPerUid;
  accept.limits.strangers = kStrangerConnections;
  accept.metrics = metrics;
  TSM_LOG(kInfo) << "connections: at most " << accept.limits.total << " open at once (of "
                 << open_files << " open files), the last " << accept.limits.owner_reserve
                 << " for uid " << policy.owner() << " alone; "
                 << (uid_connections == 0 ? std::string("no limit")
                                          : absl::StrCat("at most ", uid_connections))
                 << " per other uid (--uid-connections)";
  return accept;
}

// TENSORSHMD_TEST_CROSS_CANCEL_MS and TENSORSHMD_TEST_GROWTH_DELAY_MS, for tests that run the
// daemon (see StoreTestHooks); each one set is logged as a warning.
StoreTestHooks TestHooksFromEnvironment() {
  auto milliseconds = [](const char* variable, absl::string_view what) {
    const char* value = std::getenv(variable);
    int64_t ms = 0;
    if (value == nullptr || !absl::SimpleAtoi(value, &ms) || ms <= 0) return absl::ZeroDuration();
    TSM_LOG(kWarning) << variable << " = " << ms << ": test mode (" << what
                      << "); never in production";
    return absl::Milliseconds(ms);
  };
  StoreTestHooks hooks;
  hooks.cross_cancel_hold =
      milliseconds("TENSORSHMD_TEST_CROSS_CANCEL_MS", "answers held back, no fast path");
  hooks.growth_delay =
      milliseconds("TENSORSHMD_TEST_GROWTH_DELAY_MS", "every pool growth is slowed down");
  return hooks;
}

// Serves --metrics `flag` for `store` (started at `started`).
absl::StatusOr<std::unique_ptr<MetricsServer>> StartMetrics(const std::string& flag, Store& store,
                                                            absl::Time started) {
  absl::StatusOr<MetricsAddress> address = ParseMetricsAddress(flag);
  if (!address.ok()) return address.status();
  const MetricsInfo info{TENSORSHM_VERSION, absl::ToDoubleSeconds(started - absl::UnixEpoch())};
  // Each request reads a snapshot of the service's figures (mu_ held only while Stat's numbers
  // are copied); the counters need no lock.
  return MetricsServer::Start(*address, [&store, info] {
    return RenderMetrics(store.StatSnapshot(), store.metrics(), info);
  });
}

// The error `status` of start-up step `what` ("" for none): its code, and its message after what.
absl::Status StartError(const std::string& what, const absl::Status& status) {
  return absl::Status(status.code(),
                      what.empty() ? status.message() : absl::StrCat(what, ": ", status.message()));
}

}  // namespace

Daemon::Daemon(const DaemonOptions& options) : options_(options) {}

// Members go in reverse order of declaration (daemon.h); Serve has stopped what runs.
Daemon::~Daemon() = default;

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options,
                                                      absl::Time started) {
  std::unique_ptr<Daemon> daemon(new Daemon(options));
  // Before anything is made or recovered: a daemon that cannot give its segments to the group
  // would fail at its first segment, or halfway through a recovery.
  if (options.shm_group) {
    if (absl::Status s = CheckCanGiveToGroup(*options.shm_group); !s.ok()) return s;
  }
  const bool shared = !options.allow_uids.empty() || !options.allow_gids.empty();
  if (absl::Status s = PrepareSocketPath(options.socket, shared, geteuid()); !s.ok()) return s;
  // memfd segments live outside /dev/shm: its size does not matter to them.
  if (!options.memfd_segments) {
    if (absl::Status s =
            CheckDevShm(options.host_pool_bytes, ControlSegmentBytes(options.max_tensors));
        !s.ok()) {
      return s;
    }
  }
  RaiseOpenFileLimit();
  // The prefix is this daemon's before anything under it is looked at: a second daemon given a
  // live daemon's prefix stops here, before it could take (and on its stop remove) the live
  // daemon's segments. Held by the first member, it is released after the segments are gone.
  if (!options.memfd_segments) {
    absl::StatusOr<PrefixLock> lock = HoldPrefix(options.shm_prefix, options.socket);
    if (!lock.ok()) return lock.status();
    daemon->prefix_lock_ = *std::move(lock);
  }
  // Segments are mode 0600 whoever is admitted: clients get descriptors over the memory channel.
  // --shm-group alone opens the named host segments (0660) to a group, for servers that open
  // them by name.
  const CatalogOptions catalog_options{
      options.shm_prefix,
      options.host_pool_bytes,
      options.segment_bytes,
      options.max_tensors,
      options.memfd_segments ? SegmentBacking::kMemfd : SegmentBacking::kNamed,
      static_cast<uint32_t>(geteuid()),
      NewInstanceId(),
      options.shm_group ? std::optional<gid_t>(options.shm_group->gid) : std::nullopt};
  // Device pools first: a failure here must not touch the host segments (of a killed daemon,
  // when recovering).
  std::vector<std::unique_ptr<CudaPool>> cuda_pools;
  for (const CudaPoolSpec& spec : options.cuda_pools) {
    const std::string flag =
        absl::StrCat("--cuda-pool cuda:", spec.ordinal, "=", FormatBytes(spec.bytes));
    absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
    if (!driver.ok()) return StartError(flag, driver.status());
    const uint64_t segment = options.cuda_segment_bytes != 0
                                 ? options.cuda_segment_bytes
                                 : std::min<uint64_t>(spec.bytes, uint64_t{1} << 30);
    const CudaPoolKind kind = options.cuda_pool_kind == "vmm"   ? CudaPoolKind::kVmm
                              : options.cuda_pool_kind == "ipc" ? CudaPoolKind::kIpc
                                                                : CudaPoolKind::kAuto;
    absl::StatusOr<std::unique_ptr<CudaPool>> pool =
        CudaPool::Create(*driver, CudaPoolOptions{spec.ordinal, kind, spec.bytes, segment});
    if (!pool.ok()) return StartError(flag, pool.status());
    TSM_LOG(kInfo) << "cuda:" << spec.ordinal << " (" << FormatUuid((*pool)->uuid())
                   << "): " << CudaPoolKindName((*pool)->kind()) << " pool of "
                   << FormatBytes((*pool)->capacity_bytes()) << " through " << (*driver)->library();
    cuda_pools.push_back(*std::move(pool));
  }
  // The segments of a daemon that was killed (or kept them) are taken back, not replaced. Any
  // entry under the control segment's name starts a recovery, a symbolic link too (lstat): the
  // recovery opens it without following links and refuses what this daemon did not create.
  struct stat control_entry;
  daemon->recovering_ =
      !options.memfd_segments &&
      lstat(absl::StrCat("/dev/shm/", options.shm_prefix, ".ctl").c_str(), &control_entry) == 0;
  absl::StatusOr<std::unique_ptr<Catalog>> catalog =
      daemon->recovering_ ? Catalog::Recover(catalog_options) : Catalog::Create(catalog_options);
  if (!catalog.ok()) {
    return StartError(daemon->recovering_ ? "recovering /" + options.shm_prefix : "",
                      catalog.status());
  }
  if (daemon->recovering_) {
    TSM_LOG(kInfo) << "recovered /" << options.shm_prefix << ".*: " << (*catalog)->name_count()
                   << " published tensors, "
                   << (*catalog)->tensor_count() - (*catalog)->name_count()
                   << " unbound or unpublished ones kept for " << options.recovery_grace_seconds
                   << " s for reconnecting clients";
  }
  for (std::unique_ptr<CudaPool>& pool : cuda_pools) (*catalog)->AddCudaPool(std::move(pool));
  std::map<gid_t, std::string> admitted_groups;
  for (gid_t gid : options.allow_gids) admitted_groups[gid] = GroupName(gid);
  daemon->policy_ =
      std::make_unique<AccessPolicy>(geteuid(), options.allow_uids, std::move(admitted_groups));
  const StoreTestHooks hooks = TestHooksFromEnvironment();
  daemon->store_ =
      std::make_unique<Store>(*std::move(catalog), options.session_quota_bytes,
                              daemon->policy_.get(), &daemon->peers_, options.uid_limits, hooks);
  daemon->store_->set_evict_policy(options.evict);
  daemon->service_ = std::make_unique<TensorShmService>(*daemon->store_, hooks.cross_cancel_hold);
  daemon->cross_cancel_hold_ = hooks.cross_cancel_hold;
  if (absl::Status s = daemon->StartServing(started); !s.ok()) return s;
  return daemon;
}

absl::Status Daemon::StartServing(absl::Time started) {
  // --metrics: before the gRPC server, so that a bad address fails start-up with nothing
  // serving yet.
  if (!options_.metrics.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server =
        StartMetrics(options_.metrics, *store_, started);
    if (!server.ok()) return server.status();
    metrics_ = *std::move(server);
    TSM_LOG(kInfo) << "metrics: serving http://" << FormatMetricsAddress(metrics_->address())
                   << "/metrics";
    if (!IsLoopbackHost(metrics_->address().host)) {
      TSM_LOG(kWarning) << "metrics: --metrics " << options_.metrics
                        << " is beyond loopback: anyone who can reach it reads the daemon's "
                           "figures (no tensor names); bind 127.0.0.1 or firewall the port";
    }
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(service_.get());
  // The service uses gRPC's callback API: no call holds a thread while it waits. What stays
  // synchronous (reflection) gets a few threads, however many calls come.
  quota_ = std::make_unique<grpc::ResourceQuota>("tensorshmd");
  quota_->SetMaxThreads(kSyncServerThreads);
  builder.SetResourceQuota(*quota_);
  // Reflection is synchronous: other uids may hold one of its threads each, and never the last.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeReflectionLimit(&peers_, policy_.get(), kSyncServerThreads));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) return absl::InternalError("cannot start the gRPC server");
  server_->GetHealthCheckService()->SetServingStatus(true);
  // The daemon accepts connections itself, so that it knows who is at the other end
  // (SO_PEERCRED): a connection of a uid that is not admitted, or past its uid's or the daemon's
  // connection limit, is closed at accept; admission is checked again on every call. A shared
  // socket is open to all local users at the file level: the credentials decide.
  absl::StatusOr<std::unique_ptr<UnixListener>> listener =
      UnixListener::Create(options_.socket, policy_->shared() ? 0666 : 0600);
  if (!listener.ok()) return listener.status();
  listener_ = *std::move(listener);
  absl::StatusOr<std::unique_ptr<ChannelServer>> channels =
      ChannelServer::Start([store = store_.get(), hold = cross_cancel_hold_](
                               ChannelConnection& connection, const v1::ChannelRequest& request) {
        return HandleChannelRequest(*store, connection, request, hold);
      });
  if (!channels.ok()) return channels.status();
  channels_ = *std::move(channels);
  listener_->Start(
      [this](UniqueFd fd, const PeerCredentials& peer) {
        // gRPC names the connection "fd:N"; its calls are admitted by these credentials.
        if (absl::Status s = peers_.Add(fd.get(), peer); !s.ok()) {
          TSM_LOG(kWarning) << "connection refused: " << s.message();
          return;
        }
        TSM_LOG(kDebug) << "accepted fd " << fd.get() << ": pid " << peer.pid << ", uid "
                        << peer.uid;
        grpc::AddInsecureChannelFromFd(server_.get(), fd.release());  // gRPC closes it
      },
      [this](UniqueFd fd, const PeerCredentials& peer) {
        // The listener closed a refused peer's connections at accept already; this is the
        // second look, as every gRPC call has.
        if (absl::Status s = policy_->Admit(peer); !s.ok()) {
          TSM_LOG(kWarning) << "memory channel refused: " << s.message();
          return;
        }
        TSM_LOG(kDebug) << "memory channel fd " << fd.get() << ": pid " << peer.pid << ", uid "
                        << peer.uid;
        channels_->Add(std::move(fd), peer);
      },
      MakeAcceptPolicy(*policy_, *options_.uid_connections, &store_->metrics()));

  // The one line an operator (and a supervisor waiting for readiness) looks for: logged like
  // every other line, on stderr, and whatever --log-level says. The pool grows by segments of
  // --segment-size, never larger than the pool itself; a tensor larger than that gets a segment
  // of its own size.
  LogLine(LogLevel::kInfo)
      << "tensorshmd " << TENSORSHM_VERSION << ": serving on unix:" << options_.socket
      << "; host pool " << FormatBytes(options_.host_pool_bytes) << " in "
      << (options_.memfd_segments ? "memfd" : "shm") << " segments of up to "
      << FormatBytes(std::min(options_.segment_bytes, options_.host_pool_bytes))
      << (options_.segment_bytes < options_.host_pool_bytes
              ? " (a larger tensor gets one of its own size)"
              : "")
      << ", shm prefix /" << options_.shm_prefix
      << (options_.shm_group
              ? absl::StrCat(", host segments group-accessible: mode 0660, group ",
                             options_.shm_group->name, " (gid ", options_.shm_group->gid,
                             ", --shm-group), whose members can read and write every "
                             "tensor in them")
              : "")
      << (metrics_ != nullptr
              ? "; metrics on http://" + FormatMetricsAddress(metrics_->address()) + "/metrics"
              : "");
  return absl::OkStatus();
}

void Daemon::Serve(const sigset_t& stop_signals) {
  Store& store = *store_;
  // After the grace period, unbound and unpublished tensors nobody came back for are freed.
  absl::Notification stopping;
  std::thread grace([&] {
    if (!recovering_) return;
    if (!stopping.WaitForNotificationWithTimeout(absl::Seconds(options_.recovery_grace_seconds))) {
      const int freed = store.ExpireUnbound();
      TSM_LOG(kInfo) << "recovery grace over: freed " << freed
                     << " unbound or unpublished tensors no client took back";
    }
  });

  std::thread housekeeper([&] { store.Housekeep(); });
  std::thread waiter_timer([&] { store.ExpireWaiters(); });
  std::thread grower([&] { store.GrowPools(); });

  std::thread stopper([&] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    TSM_LOG(kInfo) << "received " << strsignal(signal_number) << ", stopping";
    // Before anything ends a session: with --keep-segments, what sessions hold is kept.
    if (options_.keep_segments) store.KeepHeldOnStop();
    server_->GetHealthCheckService()->SetServingStatus(false);
    listener_->Stop();
    if (metrics_ != nullptr) metrics_->Stop();
    stopping.Notify();
    store.BeginShutdown();
    // After the Store's shutdown began: the creates waiting on a memory channel hear that the
    // daemon stops before their connection closes.
    channels_->Stop();
    // In-flight calls get a moment to finish; session streams are then cancelled.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  });
  server_->Wait();
  stopper.join();
  grace.join();
  housekeeper.join();
  waiter_timer.join();
  grower.join();
  if (options_.keep_segments) {
    store.KeepSegments();
    if (prefix_lock_) {
      // The next daemon (and tensorshmctl leftovers) reads who kept the segments.
      char host[256] = {};
      gethostname(host, sizeof(host) - 1);
      (void)prefix_lock_->Record(PrefixHolder{getpid(), host, options_.socket, "kept"});
      prefix_lock_->Keep();
    }
  }
  server_.reset();
  listener_.reset();  // removes the socket file
  TSM_LOG(kInfo) << "stopped; socket removed, shm segments "
                 << (options_.keep_segments ? "kept (--keep-segments)" : "removed");
  // The service goes with the Daemon, and with it the catalog, which unlinks every segment.
}

}  // namespace tensorshm
