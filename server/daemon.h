// Daemon: tensorshmd's top floor below main(), the only code that knows every room. Start()
// takes what the options name, in the order that keeps a failed start harmless (the socket's
// directory, /dev/shm's room, the prefix, device pools before host segments, the catalog, the
// metrics address, the gRPC server, the socket); Serve() runs the daemon's threads until SIGTERM
// or SIGINT, then stops them in order and gives everything back.
#ifndef TENSORSHM_SERVER_DAEMON_H_
#define TENSORSHM_SERVER_DAEMON_H_

#include <grpcpp/resource_quota.h>
#include <grpcpp/server.h>
#include <signal.h>

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/prefix_lock.h"
#include "server/core/access.h"
#include "server/core/store.h"
#include "server/ops/metrics_http.h"
#include "server/ops/options.h"
#include "server/rpc/listener.h"
#include "server/rpc/memory_channel.h"
#include "server/rpc/reflection_limit.h"
#include "server/rpc/service.h"

namespace tensorshm {

class Daemon {
 public:
  // Starts the daemon `options` describe (`started`: when the process began, for the metrics'
  // uptime): serving once this returns. An error says what could not be had, naming the flag.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options,
                                                       absl::Time started);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Serves until one of `stop_signals` (blocked in every thread since before Start) comes; then
  // stops accepting, ends the sessions and, unless --keep-segments, removes the segments.
  void Serve(const sigset_t& stop_signals);

 private:
  explicit Daemon(const DaemonOptions& options);
  // Everything after the catalog: metrics, the gRPC server, the socket and the memory channel.
  absl::Status StartServing(absl::Time started);

  const DaemonOptions options_;
  bool recovering_ = false;  // the segments of a killed daemon were taken back
  // StoreTestHooks::cross_cancel_hold, for the memory channel's answers too.
  absl::Duration cross_cancel_hold_ = absl::ZeroDuration();
  // Members go in reverse order: the socket and the servers first, then the service, the store
  // (and with it the catalog, which unlinks the segments), the prefix last.
  std::optional<PrefixLock> prefix_lock_;
  std::unique_ptr<AccessPolicy> policy_;
  PeerTable peers_;
  // The state and rules; the gRPC service and the memory channel's handler are its transports.
  std::unique_ptr<Store> store_;
  std::unique_ptr<TensorShmService> service_;
  std::unique_ptr<MetricsServer> metrics_;
  std::unique_ptr<grpc::ResourceQuota> quota_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixListener> listener_;
  std::unique_ptr<ChannelServer> channels_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_DAEMON_H_
