#include "client/admin.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/fork.h"
#include "common/base/socket_path.h"
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
      ", or the packaged daemon of /run/tensorshm/tensorshm.sock in a directory only root could "
      "have made for it. A daemon of another user reads and can change every tensor that "
      "passes through it, and another user may have taken over the socket's path. If that "
      "daemon is the one to use, name its uid: TENSORSHM_SERVER_UID=",
      peer.uid, " in the environment, or ClientOptions::server_uid = ", peer.uid,
      " (C: tsm_connect_server_uid; Python: tensorshm.connect(..., server_uid=", peer.uid,
      "); tensorshmctl --server-uid ", peer.uid, ")"));
}

// Whether `path` is a directory (not a link to one) owned by `owner` that no one else can write.
bool OwnedDirectory(const std::string& path, uid_t owner) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == owner &&
         (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

}  // namespace

absl::StatusOr<std::optional<uint32_t>> ServerUidOrEnvironment(std::optional<uint32_t> given) {
  if (given.has_value()) return given;
  const char* value = std::getenv("TENSORSHM_SERVER_UID");
  if (value == nullptr || *value == '\0') return std::nullopt;
  uint32_t uid = 0;
  if (!absl::SimpleAtoi(value, &uid) || uid == static_cast<uint32_t>(-1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("$TENSORSHM_SERVER_UID = \"", value, "\": not a uid (a number, e.g. 1000)"));
  }
  return uid;
}

bool InDirectoryRootMadeFor(const std::string& socket, uint32_t server) {
  // Only the packaged daemon's path, spelled exactly: any directory root made for a user (its
  // home, logind's /run/user/UID) would otherwise pass for a daemon's, and a client whose
  // $XDG_RUNTIME_DIR is another user's (su, sudo -E) would trust that user.
  if (socket != kSystemSocketPath) return false;
  const size_t slash = socket.rfind('/');
  struct stat st {};
  if (::lstat(socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  std::string directory = socket.substr(0, slash);
  if (!OwnedDirectory(directory, server)) return false;
  // Every directory above, up to /, root's alone: no one else can have made, renamed or replaced
  // the one below.
  while (!directory.empty()) {
    directory.resize(directory.rfind('/'));
    if (!OwnedDirectory(directory.empty() ? "/" : directory, 0)) return false;
  }
  return true;
}

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
      (server_uid.has_value() && peer->uid == *server_uid) ||
      InDirectoryRootMadeFor(socket, peer->uid)) {
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
