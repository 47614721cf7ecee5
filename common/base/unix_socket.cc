#include "common/base/unix_socket.h"

#include <sys/socket.h>

#include <cerrno>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"

namespace tensorshm {

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd, absl::string_view name,
                                                    bool with_groups) {
  auto shown = [&] { return name.empty() ? absl::StrCat("fd ", fd) : std::string(name); };
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    const int err = errno;
    return ErrnoError("getsockopt(SO_PEERCRED)", shown(), err);
  }
  PeerCredentials peer{credentials.pid, credentials.uid, credentials.gid, nullptr};
  if (!with_groups) return peer;
  // Most processes have a few groups; ERANGE says how many more room it takes.
  auto groups = std::make_shared<std::vector<gid_t>>(16);
  while (true) {
    length = static_cast<socklen_t>(groups->size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups->data(), &length) == 0) break;
    const int err = errno;
    // A kernel without SO_PEERGROUPS (before Linux 4.13, some sandboxes): no supplementary
    // groups, so admission goes by uid and primary gid alone.
    if (err == ENOPROTOOPT || err == EOPNOTSUPP) return peer;
    if (err != ERANGE || length <= groups->size() * sizeof(gid_t)) {
      return ErrnoError("getsockopt(SO_PEERGROUPS)", shown(), err);
    }
    groups->resize(length / sizeof(gid_t));
  }
  groups->resize(length / sizeof(gid_t));
  peer.groups = std::move(groups);
  return peer;
}

}  // namespace tensorshm
