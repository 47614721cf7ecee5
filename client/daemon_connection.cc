#include "client/daemon_connection.h"

#include <fcntl.h>
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/support/channel_arguments.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"

namespace tensorshm {
absl::StatusOr<std::shared_ptr<DaemonConnection>> DaemonConnection::Connect(
    const std::string& socket, std::optional<uint32_t> server_uid) {
  absl::StatusOr<int> fd = ConnectToDaemon(socket, server_uid);
  if (!fd.ok()) return fd.status();
  const int watch = fcntl(*fd, F_DUPFD_CLOEXEC, 0);
  if (watch < 0) {
    const int err = errno;
    close(*fd);
    return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", socket, err);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // gRPC takes the descriptor: the channel runs on exactly the connection checked above, and
  // never connects again by itself (a reconnect is a new, checked DaemonConnection).
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomInsecureChannelFromFd(absl::StrCat("unix:", socket), *fd, args);
  return std::shared_ptr<DaemonConnection>(new DaemonConnection(std::move(channel), watch));
}

DaemonConnection::~DaemonConnection() { close(watch_fd_); }

bool DaemonConnection::Broken() const {
  pollfd watched{watch_fd_, POLLRDHUP, 0};
  return poll(&watched, 1, 0) == 1 && (watched.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace tensorshm
