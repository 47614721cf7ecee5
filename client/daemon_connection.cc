#include "client/daemon_connection.h"

#include <fcntl.h>
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/support/channel_arguments.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"
#include "common/base/unique_fd.h"

namespace tensorshm {
absl::StatusOr<std::shared_ptr<DaemonConnection>> DaemonConnection::Connect(
    const std::string& socket, std::optional<uint32_t> server_uid) {
  absl::StatusOr<UniqueFd> connected = ConnectToDaemon(socket, server_uid);
  if (!connected.ok()) return connected.status();
  UniqueFd fd = *std::move(connected);
  UniqueFd watch(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!watch) return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", socket, errno);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // gRPC takes the descriptor: the channel runs on exactly the connection checked above, and
  // never connects again by itself (a reconnect is a new, checked DaemonConnection).
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomInsecureChannelFromFd(absl::StrCat("unix:", socket), fd.release(), args);
  return std::shared_ptr<DaemonConnection>(
      new DaemonConnection(std::move(channel), std::move(watch)));
}

DaemonConnection::~DaemonConnection() = default;

bool DaemonConnection::Broken() const {
  pollfd watched{watch_fd_.get(), POLLRDHUP, 0};
  return poll(&watched, 1, 0) == 1 && (watched.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace tensorshm
