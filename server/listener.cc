#include "server/listener.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/sys_error.h"
#include "server/log.h"

namespace tensorshm {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Create(const std::string& path,
                                                                   mode_t mode) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError("--socket = \"" + path + "\": too long for a Unix socket");
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("socket", path, errno);
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError("bind", path, err);
  }
  // The mode is set before listen(): nobody can connect in between.
  if (chmod(path.c_str(), mode) != 0 || listen(fd, 512) != 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    return ErrnoError("chmod/listen", path, err);
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, fd));
}

UnixListener::~UnixListener() {
  Stop();
  close(fd_);
  unlink(path_.c_str());
}

void UnixListener::Start(std::function<void(int fd, const PeerCredentials&)> on_accept) {
  thread_ = std::thread([this, on_accept = std::move(on_accept)] {
    while (true) {
      const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE) {
          TSM_LOG(kWarning) << "accept on " << path_ << ": " << std::strerror(errno);
          usleep(10000);
          continue;
        }
        return;  // the listener was shut down (EINVAL) or broke
      }
      absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd);
      if (!peer.ok()) {
        TSM_LOG(kWarning) << peer.status().message();
        close(fd);
        continue;
      }
      on_accept(fd, *peer);
    }
  });
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  shutdown(fd_, SHUT_RDWR);  // wakes accept4 with EINVAL
  thread_.join();
}

}  // namespace tensorshm
