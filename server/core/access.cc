#include "server/core/access.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"

namespace tensorshm {

bool SeesDetailsOf(const AccessPolicy* policy, const PeerCredentials& caller, uint32_t uid) {
  return policy == nullptr || caller.uid == uid || caller.uid == policy->owner() || caller.uid == 0;
}

absl::Status AccessPolicy::Admit(const PeerCredentials& peer) const {
  if (peer.uid == owner_ || uids_.count(peer.uid) > 0 || gids_.count(peer.gid) > 0) {
    return absl::OkStatus();
  }
  if (peer.groups != nullptr && !gids_.empty()) {
    for (gid_t group : *peer.groups) {
      if (gids_.count(group) > 0) return absl::OkStatus();
    }
  }
  // Which uids are admitted is the operator's business, not a stranger's: the refusal names the
  // caller and the flags, never the list. The groups are how a user gets in: named.
  std::string how =
      "it admits its own uid and those its operator named (--allow-uid / --allow-gid)";
  if (!gids_.empty()) {
    std::string names;
    for (const auto& [gid, name] : gids_) {
      absl::StrAppend(&names, names.empty() ? "" : ", ", name);
    }
    const std::string& first = gids_.begin()->second;
    how = absl::StrCat(
        "it admits its own uid, those its operator named (--allow-uid) and the "
        "members of group ",
        names,
        " (--allow-gid): to be admitted, join it "
        "(usermod -aG ",
        first, " USER, then log in again)");
  }
  return absl::PermissionDeniedError(absl::StrCat("uid ", peer.uid, ", gid ", peer.gid, " (pid ",
                                                  peer.pid,
                                                  ") may not use this tensorshmd: ", how));
}

absl::Status PeerTable::Add(int fd, const PeerCredentials& credentials) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoError("fstat", absl::StrCat("accepted fd ", fd), errno);
  MutexLock lock(&mu_);
  // The number may be an old connection's: its entry is replaced, never inherited.
  peers_[fd] = Entry{credentials, st.st_dev, st.st_ino};
  // A look at every entry costs one fstat each: taken after as many adds as half the entries
  // (at least 64), it costs a few per add.
  if (++adds_since_sweep_ >= std::max<size_t>(64, peers_.size() / 2)) {
    Sweep();
    adds_since_sweep_ = 0;
  }
  return absl::OkStatus();
}

bool PeerTable::StillOpen(int fd, const Entry& entry) {
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_dev == entry.device && st.st_ino == entry.inode;
}

void PeerTable::Sweep() {
  for (auto it = peers_.begin(); it != peers_.end();) {
    it = StillOpen(it->first, it->second) ? std::next(it) : peers_.erase(it);
  }
}

absl::StatusOr<PeerCredentials> PeerTable::Find(const std::string& peer) const {
  int fd = -1;
  if (!absl::StartsWith(peer, "fd:") || !absl::SimpleAtoi(peer.substr(3), &fd) || fd < 0) {
    return absl::NotFoundError(absl::StrCat("peer ", peer, ": not accepted by this daemon"));
  }
  MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("peer ", peer, ": not accepted by this daemon"));
  }
  if (!StillOpen(fd, it->second)) {
    return absl::NotFoundError(
        absl::StrCat("peer ", peer, ": the connection accepted on this descriptor has closed"));
  }
  return it->second.credentials;
}

size_t PeerTable::size() const {
  MutexLock lock(&mu_);
  return peers_.size();
}

}  // namespace tensorshm
