#include "common/base/unix_socket.h"

#include <sys/socket.h>

#include <cerrno>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"

namespace tensorshm {

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd, absl::string_view name) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    const int err = errno;
    return ErrnoError("getsockopt(SO_PEERCRED)",
                      name.empty() ? absl::StrCat("fd ", fd) : std::string(name), err);
  }
  return PeerCredentials{credentials.pid, credentials.uid, credentials.gid};
}

}  // namespace tensorshm
