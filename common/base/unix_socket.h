// Unix domain sockets: who is at the other end of a connection, as the kernel recorded it
// (SO_PEERCRED). Both sides ask: the daemon of each connection it accepts, the client of the
// process that made the daemon's socket listen.
#ifndef TENSORSHM_COMMON_BASE_UNIX_SOCKET_H_
#define TENSORSHM_COMMON_BASE_UNIX_SOCKET_H_

#include <sys/types.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorshm {

// The process at the other end of a Unix connection: for an accepted connection, the one that
// called connect(); for a connected one, the one that called listen(). pid is 0 when that
// process is not visible in this pid namespace.
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  // Its supplementary groups when connect() was called (SO_PEERGROUPS), when they were asked
  // for; null otherwise. Shared: credentials are copied per call.
  std::shared_ptr<const std::vector<gid_t>> groups = nullptr;
};

// Reads the credentials of the peer of connected Unix socket `fd` (borrowed), with its
// supplementary groups when `with_groups`. Errors: getsockopt(SO_PEERCRED)'s or
// getsockopt(SO_PEERGROUPS)'s, naming `name`, or "fd N" when `name` is empty.
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd, absl::string_view name = {},
                                                    bool with_groups = false);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_UNIX_SOCKET_H_
