// The daemon's own Unix socket: it accepts connections itself, reads each peer's credentials,
// and tells gRPC connections (HTTP/2 preface "PRI * ...") from memory channel connections
// ("TSMCHAN1") by their first bytes before handing them on. Admission comes first: a connection
// of a peer that is not admitted, or past its uid's or the daemon's connection limit, is closed
// as soon as it is accepted, before anything else is spent on it.
#ifndef TENSORSHM_SERVER_RPC_LISTENER_H_
#define TENSORSHM_SERVER_RPC_LISTENER_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/event_loop.h"
#include "common/base/unique_fd.h"
#include "server/core/access.h"
#include "server/ops/metrics.h"
#include "server/rpc/connection_table.h"

namespace tensorshm {

// Who the listener lets in, checked at accept.
struct AcceptPolicy {
  // OK if the peer may use the daemon at all (AccessPolicy::Admit); empty: everyone may.
  std::function<absl::Status(const PeerCredentials&)> admit;
  // Whether `admit` needs the peer's supplementary groups (SO_PEERGROUPS at each accept).
  bool needs_groups = false;
  ConnectionLimits limits;  // zeros: none
  // Counts refused connections (CountConnectionRefused) and the connections open
  // (SetConnections); may be null. Must outlive the listener's thread.
  Metrics* metrics = nullptr;
};

// Move-only; closing the listener stops the accept loop and removes the socket file.
class UnixListener {
 public:
  // Called with an accepted connection (non-blocking, close-on-exec) and its peer's
  // credentials.
  using Handoff = std::function<void(UniqueFd fd, const PeerCredentials&)>;

  // Binds and listens on `path` with file mode `mode`. Errors name the call and the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Create(const std::string& path, mode_t mode);
  ~UnixListener();

  // Starts a thread accepting connections. A connection that `policy` refuses is closed at once
  // (logged at most once per uid every 10 s, with a count). The others are each handed to
  // `on_grpc` with their first bytes still unread, or, once their hello has been read off, to
  // `on_channel`. A connection that sends anything else, or not enough to tell within
  // `sort_timeout`, is closed (logged, as refusals are).
  void Start(Handoff on_grpc, Handoff on_channel, AcceptPolicy policy = {},
             absl::Duration sort_timeout = absl::Seconds(10));
  // Stops accepting and joins the thread; idempotent. Connections not yet sorted are closed.
  void Stop();

 private:
  UnixListener(std::string path, UniqueFd fd, std::unique_ptr<EventLoop> loop)
      : path_(std::move(path)), fd_(std::move(fd)), loop_(std::move(loop)) {}
  void Run(const Handoff& on_grpc, const Handoff& on_channel, const AcceptPolicy& policy,
           absl::Duration sort_timeout);
  std::string path_;
  UniqueFd fd_;
  std::unique_ptr<EventLoop> loop_;  // the accept thread's; Stop() stops it
  std::thread thread_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_LISTENER_H_
