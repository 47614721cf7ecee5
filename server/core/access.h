// Who may talk to tensorshmd: the peer credentials of each Unix connection, read with
// SO_PEERCRED when the daemon accepts it, checked against the policy (the daemon's own uid, plus
// --allow-uid / --allow-gid).
#ifndef TENSORSHM_SERVER_CORE_ACCESS_H_
#define TENSORSHM_SERVER_CORE_ACCESS_H_

#include <sys/types.h>

#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/mutex.h"
#include "common/base/unix_socket.h"  // PeerCredentials, ReadPeerCredentials

namespace tensorshm {

// Immutable after construction; thread-safe.
class AccessPolicy {
 public:
  // `gids`: each admitted group's gid and name (a group's members are told its name).
  AccessPolicy(uid_t owner, std::set<uid_t> uids, std::map<gid_t, std::string> gids)
      : owner_(owner), uids_(std::move(uids)), gids_(std::move(gids)) {}

  // OK if `peer` may connect: its uid is the daemon's or allowed, or its primary gid or one of
  // its supplementary groups (peer.groups) is allowed. PERMISSION_DENIED naming the uid, gid and
  // pid otherwise, and the groups that would admit it (never the admitted uids).
  absl::Status Admit(const PeerCredentials& peer) const;
  // Whether anyone but the owner is admitted (the socket and segments must then be shared).
  bool shared() const { return !uids_.empty() || !gids_.empty(); }
  // Whether Admit looks at supplementary groups (PeerCredentials::groups): only with --allow-gid.
  bool admits_groups() const { return !gids_.empty(); }
  uid_t owner() const { return owner_; }

 private:
  uid_t owner_;
  std::set<uid_t> uids_;
  std::map<gid_t, std::string> gids_;
};

// Whether `caller` sees every detail of what uid `uid`'s processes do (their pids, client names):
// true for that uid itself, the policy's owner and root, and without a policy (null). See
// SessionsRequest in the .proto for why others see less.
bool SeesDetailsOf(const AccessPolicy* policy, const PeerCredentials& caller, uint32_t uid);

// The credentials of every accepted gRPC connection, by its descriptor, which gRPC reports as
// the peer "fd:N". gRPC closes the descriptor when the connection ends, and the number is then
// reused: so each entry also holds the socket the descriptor was (device and inode), and answers
// only while descriptor N is still that socket. Entries whose descriptor is closed or is another
// file now are dropped by a look at every entry after every max(64, entries / 2) adds.
// Thread-safe.
class PeerTable {
 public:
  // Records `credentials` for accepted socket `fd`. An error naming the fd if fstat fails.
  absl::Status Add(int fd, const PeerCredentials& credentials) ABSL_LOCKS_EXCLUDED(mu_);
  // The credentials of `peer` ("fd:N"); NOT_FOUND for a connection the daemon did not accept
  // itself, or whose descriptor is no longer the socket it accepted.
  absl::StatusOr<PeerCredentials> Find(const std::string& peer) const ABSL_LOCKS_EXCLUDED(mu_);
  // Entries held now (live or not yet dropped).
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    PeerCredentials credentials;
    dev_t device = 0;
    ino_t inode = 0;
  };
  // Whether descriptor `fd` is still the socket `entry` was made for.
  static bool StillOpen(int fd, const Entry& entry);
  // Drops the entries of descriptors that are no longer their socket.
  void Sweep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  std::map<int, Entry> peers_ ABSL_GUARDED_BY(mu_);
  size_t adds_since_sweep_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_ACCESS_H_
