#include "server/access.h"

#include <sys/socket.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/sys_error.h"

namespace tensorshm {

absl::Status AccessPolicy::Admit(const PeerCredentials& peer) const {
  if (peer.uid == owner_ || uids_.count(peer.uid) > 0 || gids_.count(peer.gid) > 0) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat("uid ", peer.uid, ", gid ", peer.gid, " (pid ",
                                                  peer.pid,
                                                  ") may not use this tensorshmd: ", Describe()));
}

std::string AccessPolicy::Describe() const {
  std::string text = absl::StrCat("it admits uid ", owner_);
  if (!uids_.empty()) absl::StrAppend(&text, ", uids ", absl::StrJoin(uids_, ","));
  if (!gids_.empty()) absl::StrAppend(&text, ", gids ", absl::StrJoin(gids_, ","));
  absl::StrAppend(&text, " (--allow-uid / --allow-gid)");
  return text;
}

void PeerTable::Add(const std::string& peer, const PeerCredentials& credentials) {
  MutexLock lock(&mu_);
  peers_[peer] = credentials;
}

void PeerTable::Remove(const std::string& peer) {
  MutexLock lock(&mu_);
  peers_.erase(peer);
}

absl::StatusOr<PeerCredentials> PeerTable::Find(const std::string& peer) const {
  MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("peer ", peer, ": not accepted by this daemon"));
  }
  return it->second;
}

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd) {
  struct ucred credentials;
  socklen_t length = sizeof(credentials);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    return ErrnoError("getsockopt(SO_PEERCRED)", absl::StrCat("fd ", fd), errno);
  }
  return PeerCredentials{credentials.pid, credentials.uid, credentials.gid};
}

}  // namespace tensorshm
