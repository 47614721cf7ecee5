// The daemon's own Unix socket: it accepts connections itself, reads each peer's credentials,
// and hands the connection to gRPC.
#ifndef TENSORSHM_SERVER_LISTENER_H_
#define TENSORSHM_SERVER_LISTENER_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/access.h"

namespace tensorshm {

// Move-only; closing the listener stops the accept loop and removes the socket file.
class UnixListener {
 public:
  // Binds and listens on `path` with file mode `mode`. Errors name the call and the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Create(const std::string& path, mode_t mode);
  ~UnixListener();

  // Starts a thread accepting connections; each accepted fd (non-blocking, close-on-exec) is
  // passed to `on_accept` with its peer's credentials. The callback owns the fd.
  void Start(std::function<void(int fd, const PeerCredentials&)> on_accept);
  // Stops accepting and joins the thread; idempotent.
  void Stop();

 private:
  UnixListener(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
  std::thread thread_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_LISTENER_H_
