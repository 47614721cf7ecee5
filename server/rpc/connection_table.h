// The connections tensorshmd has accepted on its socket and not yet seen closed, by uid: what
// --uid-connections and the daemon-wide connection limit count, so that nobody can take the
// daemon's descriptors from the sessions already open (issue 22). Also the per-uid rate limit
// of the log lines about refused connections.
#ifndef TENSORSHM_SERVER_RPC_CONNECTION_TABLE_H_
#define TENSORSHM_SERVER_RPC_CONNECTION_TABLE_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/ops/metrics.h"

namespace tensorshm {

struct ConnectionLimits {
  uid_t owner = 0;       // the daemon's own uid: not held to `per_uid`
  uint64_t per_uid = 0;  // --uid-connections: most open at once per uid but the owner; 0: none
  uint64_t total = 0;    // most open at once in all (DaemonConnectionLimit); 0: none
  // Of `total`, the last this many are the owner's alone: other uids are refused at
  // total - owner_reserve, so that the daemon's own clients still get in.
  uint64_t owner_reserve = 0;
  // Connections of uids that are not admitted held open, per uid and in all, so that their gRPC
  // calls can be answered PERMISSION_DENIED naming the policy (rather than a bare closed
  // connection); past either, closed at accept. 0: none held.
  uint64_t stranger_per_uid = 0;
  uint64_t strangers = 0;
};

// What tensorshmd holds of uids that are not admitted: enough for a client to be told why.
inline constexpr uint64_t kStrangerConnectionsPerUid = 4;
inline constexpr uint64_t kStrangerConnections = 64;

// The daemon-wide limit for a process whose open file limit is `open_files`: every connection
// is a descriptor, and so is every session's lease page (one session: two connections, one
// page) and every segment. A reserve of max(64, open_files / 16) is left for segments, segment
// grants and the daemon's own files, and two thirds of the rest go to connections, the other
// third to the lease pages of the sessions they can open. `*owner_reserve` is set to the part
// of the result that only the owner may use: min(256, result / 8).
uint64_t DaemonConnectionLimit(uint64_t open_files, uint64_t* owner_reserve);

// Thread-compatible: the listener's thread alone uses it.
//
// The listener hands its connections over (to gRPC, to the memory channel), and whoever owns
// one then closes it without telling: an entry holds the socket the descriptor was (device and
// inode) and is dropped once descriptor N is closed or another file. Such stale entries are
// found by a look (an fstat each) at a uid's entries when that uid seems to be at its limit, at
// every entry when the daemon seems to be, and at every entry by Sweep(); each look at most once
// per kSweepInterval, so that a uid knocking past its limit costs a bounded number of fstats.
class ConnectionTable {
 public:
  static constexpr absl::Duration kSweepInterval = absl::Milliseconds(10);

  explicit ConnectionTable(ConnectionLimits limits) : limits_(limits) {}

  // Whether one more connection of `uid` (`admitted` or not) fits: kNone, or which limit
  // refuses it (kNotAdmitted: past the strangers' room; kUidLimit, kDaemonLimit).
  ConnectionRefusal Check(uid_t uid, bool admitted, absl::Time now);
  // Records accepted socket `fd` of `uid`. Whatever was recorded under fd's number before has
  // closed (the number was reused) and is forgotten. An error naming the fd if fstat fails (the
  // caller then closes it).
  absl::Status Add(int fd, uid_t uid, bool admitted);
  // Forgets what is recorded under `fd`: the caller closes it now, or accept() just returned
  // that number (so what was recorded under it has closed; the listener forgets it before Check,
  // which would otherwise count it until the uid's next look).
  void Remove(int fd);
  // Drops every entry whose descriptor is closed or another file now.
  void Sweep(absl::Time now);

  uint64_t total() const { return entries_.size(); }
  uint64_t strangers() const { return strangers_; }
  uint64_t count(uid_t uid) const;
  const ConnectionLimits& limits() const { return limits_; }

 private:
  struct Entry {
    uid_t uid = 0;
    bool admitted = true;
    dev_t device = 0;
    ino_t inode = 0;
  };
  struct Uid {
    std::unordered_set<int> fds;
    absl::Time last_sweep = absl::InfinitePast();
  };
  static bool StillOpen(int fd, const Entry& entry);
  void Forget(int fd);  // drops entry `fd` if there is one
  void SweepUid(uid_t uid, absl::Time now);

  ConnectionLimits limits_;
  std::unordered_map<int, Entry> entries_;  // by descriptor
  std::unordered_map<uid_t, Uid> uids_;     // uids with entries
  absl::Time last_sweep_ = absl::InfinitePast();
  uint64_t strangers_ = 0;  // entries not admitted
};

// Log lines about refused connections, at most one per uid per `interval`: the first refusal of
// a uid is logged whole; later ones are counted, and Flush() logs "N more" for each uid whose
// interval has passed. A uid flooding the socket costs the log a line per interval, however many
// connections it makes. Thread-compatible.
class RefusalLog {
 public:
  // The uid under which failures that have no peer (accept itself failing) are logged.
  static constexpr uid_t kNoUid = static_cast<uid_t>(-1);

  explicit RefusalLog(absl::Duration interval = absl::Seconds(10)) : interval_(interval) {}

  // Logs `line` (a warning) now, or counts it if a line for `uid` was logged less than an
  // interval ago.
  void Refused(uid_t uid, const std::string& line, absl::Time now);
  // Logs the counts whose interval has passed, and forgets uids quiet for an interval.
  void Flush(absl::Time now);
  // When Flush next has something to log; InfiniteFuture if nothing.
  absl::Time NextFlush() const;

 private:
  struct Uid {
    absl::Time logged;      // when the last line was written
    uint64_t unlogged = 0;  // refusals since then
    std::string last;       // the latest refusal's line
  };
  absl::Duration interval_;
  std::unordered_map<uid_t, Uid> uids_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_CONNECTION_TABLE_H_
