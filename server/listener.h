// The daemon's own Unix socket: it accepts connections itself, reads each peer's credentials,
// and tells gRPC connections (HTTP/2 preface "PRI * ...") from memory channel connections
// ("TSMCHAN1") by their first bytes before handing them on.
#ifndef TENSORSHM_SERVER_LISTENER_H_
#define TENSORSHM_SERVER_LISTENER_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/access.h"

namespace tensorshm {

// Move-only; closing the listener stops the accept loop and removes the socket file.
class UnixListener {
 public:
  // Called with an accepted connection (non-blocking, close-on-exec) and its peer's
  // credentials; the callback owns the fd.
  using Handoff = std::function<void(int fd, const PeerCredentials&)>;

  // Binds and listens on `path` with file mode `mode`. Errors name the call and the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Create(const std::string& path, mode_t mode);
  ~UnixListener();

  // Starts a thread accepting connections. Each is handed to `on_grpc` with its first bytes
  // still unread, or, once its hello has been read off it, to `on_channel`. A connection that
  // sends anything else, or not enough to tell within `sort_timeout`, is closed (logged).
  void Start(Handoff on_grpc, Handoff on_channel, absl::Duration sort_timeout = absl::Seconds(10));
  // Stops accepting and joins the thread; idempotent. Connections not yet sorted are closed.
  void Stop();

 private:
  UnixListener(std::string path, int fd, int wake_fd)
      : path_(std::move(path)), fd_(fd), wake_fd_(wake_fd) {}
  void Run(const Handoff& on_grpc, const Handoff& on_channel, absl::Duration sort_timeout);
  std::string path_;
  int fd_;
  int wake_fd_;  // an eventfd that Stop() signals
  std::thread thread_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_LISTENER_H_
