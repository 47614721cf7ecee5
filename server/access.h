// Who may talk to tensorshmd: the peer credentials of each Unix connection, read with
// SO_PEERCRED when the daemon accepts it, checked against the policy (the daemon's own uid, plus
// --allow-uid / --allow-gid).
#ifndef TENSORSHM_SERVER_ACCESS_H_
#define TENSORSHM_SERVER_ACCESS_H_

#include <sys/types.h>

#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mutex.h"

namespace tensorshm {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Immutable after construction; thread-safe.
class AccessPolicy {
 public:
  AccessPolicy(uid_t owner, std::set<uid_t> uids, std::set<gid_t> gids)
      : owner_(owner), uids_(std::move(uids)), gids_(std::move(gids)) {}

  // OK if `peer` may connect: its uid is the daemon's or allowed, or its primary gid is allowed.
  // PERMISSION_DENIED naming the uid, gid, pid and the policy otherwise.
  absl::Status Admit(const PeerCredentials& peer) const;
  // Whether anyone but the owner is admitted (the socket and segments must then be shared).
  bool shared() const { return !uids_.empty() || !gids_.empty(); }
  uid_t owner() const { return owner_; }
  const std::set<gid_t>& gids() const { return gids_; }
  std::string Describe() const;

 private:
  uid_t owner_;
  std::set<uid_t> uids_;
  std::set<gid_t> gids_;
};

// The credentials of every accepted connection, by the peer string gRPC reports for it.
// Thread-safe.
class PeerTable {
 public:
  void Add(const std::string& peer, const PeerCredentials& credentials);
  void Remove(const std::string& peer);
  // The credentials of `peer`; NOT_FOUND for a connection the daemon did not accept itself.
  absl::StatusOr<PeerCredentials> Find(const std::string& peer) const;

 private:
  mutable Mutex mu_;
  std::map<std::string, PeerCredentials> peers_ ABSL_GUARDED_BY(mu_);
};

// Reads the credentials of the process at the other end of Unix socket `fd`.
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_ACCESS_H_
