#include "client/admin.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/fork.h"
#include "common/base/sys_error.h"
#include "common/base/unique_fd.h"
#include "common/base/unix_socket.h"

namespace tensorshm {

namespace {

// PERMISSION_DENIED for a daemon socket `where` served by `peer`, which is none of the uids the
// client accepts.
absl::Status UntrustedServer(const std::string& where, const PeerCredentials& peer,
                             std::optional<uint32_t> server_uid) {
  const uid_t euid = geteuid();
  std::string expected = absl::StrCat("uid ", euid, " (this process's own)");
  if (euid != 0) absl::StrAppend(&expected, ", uid 0 (root)");
  if (server_uid.has_value() && *server_uid != euid && *server_uid != 0) {
    absl::StrAppend(&expected, ", uid ", *server_uid, " (server_uid)");
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "tensorshmd at ", where, " is served by uid ", peer.uid, " (pid ", peer.pid,
      "), which this client does not trust: it expects ", expected,
      ". A daemon of another user reads and can change every tensor that passes through it, and "
      "another user may have taken over the socket's path. If that daemon is the one to use, "
      "name its uid: ClientOptions::server_uid = ",
      peer.uid, " (C: tsm_connect_server_uid; Python: tensorshm.connect(..., server_uid=", peer.uid,
      "))"));
}

}  // namespace

absl::StatusOr<UniqueFd> ConnectToDaemon(const std::string& socket,
                                         std::optional<uint32_t> server_uid) {
  const std::string where = absl::StrCat("unix:", socket);
  sockaddr_un address{};
  if (socket.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket = \"", socket, "\": longer than ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return ErrnoError("socket", where, errno);
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket.data(), socket.size());
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect(", where, "): ", std::strerror(errno)));
  }
  // The credentials of the process that made the socket listen, as the kernel recorded them: a
  // file's owner or mode could be anyone's, this cannot.
  absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd.get(), where);
  if (!peer.ok()) return peer.status();
  if (peer->uid == geteuid() || peer->uid == 0 ||
      (server_uid.has_value() && peer->uid == *server_uid)) {
    // The daemon's end as the kernel names it (a relative, linked or bind-mounted path given to
    // the client may differ): what a fork child recognises the parent's connections by.
    sockaddr_un name{};
    socklen_t name_length = sizeof(name);
    if (getpeername(fd.get(), reinterpret_cast<sockaddr*>(&name), &name_length) == 0 &&
        name.sun_family == AF_UNIX && name_length > offsetof(sockaddr_un, sun_path)) {
      RememberDaemonSocket(
          std::string(name.sun_path, strnlen(name.sun_path, sizeof(name.sun_path))));
    }
    return fd;
  }
  return UntrustedServer(where, *peer, server_uid);
}

}  // namespace tensorshm
