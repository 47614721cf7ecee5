// Per-uid limits (--uid-sessions, --uid-leases, --uid-waiters, --uid-quota, --uid-tensors): what
// all sessions of one uid hold together, so that a uid does not get N times the room by opening N
// sessions, and one admitted uid cannot exhaust the daemon's memory or threads for the others.
#ifndef TENSORSHM_SERVER_OPS_UID_LIMITS_H_
#define TENSORSHM_SERVER_OPS_UID_LIMITS_H_

#include <cstdint>
#include <map>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"

namespace tensorshm {

// The most one uid may hold at once; 0 in a field: no limit. (The daemon's defaults are
// DefaultUidLimits() in server/ops/options.h; these zeros are for code that wants no limits.)
struct UidLimitsConfig {
  uint64_t sessions = 0;           // --uid-sessions: open sessions
  uint64_t leases = 0;             // --uid-leases: leases held, RPC and lease page slots counted
  uint64_t waiters = 0;            // --uid-waiters: Acquire calls waiting in the daemon
  uint64_t unpublished_bytes = 0;  // --uid-quota: bytes of created, unpublished buffers
  // --uid-tensors: tensor records (published tensors, zero-byte ones included, and unpublished
  // creates). Records outlive sessions, so the catalog counts them, not a SessionCharge (see
  // Catalog::RoomForRecord); the limit is here with the others.
  uint64_t tensors = 0;
};

// The default of --uid-tensors: an even share of the catalog's `max_tensors` records between the
// uids the daemon admits, which are `owner_uid` (the daemon's own), each of `allow_uids`, and one
// more per entry of `allow_gids` (a group's members share one such share each: a daemon admitting
// a group of many uids should set --uid-tensors). At least 1. With no other uid admitted it is
// `max_tensors`, the whole catalog. As the shares add up to at most `max_tensors`, no admitted
// uid can take the records another one is entitled to, whoever creates first.
uint64_t FairTensorShare(uint64_t max_tensors, uint32_t owner_uid,
                         const std::set<uint32_t>& allow_uids, size_t allow_gids);

// RESOURCE_EXHAUSTED for a create of `uid`, which holds `records` tensor records against the
// --uid-tensors `limit`: names the uid, its records, the limit and the flag.
absl::Status TensorRecordsExhausted(uint32_t uid, uint64_t records, uint64_t limit);

// What one uid holds now.
struct UidUsage {
  uint64_t sessions = 0;
  uint64_t leases = 0;
  uint64_t waiters = 0;
  uint64_t unpublished_bytes = 0;
  // Open sessions that have created host tensors: the uid shares the host pool (see
  // HostPool::FairShare). Not limited.
  uint64_t creating_sessions = 0;

  bool empty() const {
    return sessions == 0 && leases == 0 && waiters == 0 && unpublished_bytes == 0 &&
           creating_sessions == 0;
  }
};

// The counts of every uid that holds anything, against one UidLimitsConfig. What is counted is
// handed out as charges (SessionCharge, WaitCharge) that give their part back when destroyed,
// so a session or a wait that ends by any path leaves nothing counted.
//
// Thread-safe: the counts have a mutex of their own, so callers need no lock of theirs (a
// charge itself is not thread-safe: its owner serialises calls on it). Every charge must be
// destroyed before the UidLimits that made it.
class UidLimits {
 public:
  class SessionCharge;
  class WaitCharge;

  explicit UidLimits(const UidLimitsConfig& config) : config_(config) {}
  UidLimits(const UidLimits&) = delete;
  UidLimits& operator=(const UidLimits&) = delete;
  ~UidLimits();  // REQUIRES: every charge it made is gone

  // Counts a new session of `uid`; the charge holds it (and the session's leases and unpublished
  // bytes) until destroyed. RESOURCE_EXHAUSTED naming the uid, its sessions, the limit and
  // --uid-sessions if the uid has as many open as allowed.
  absl::StatusOr<SessionCharge> OpenSession(uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);

  // Counts an Acquire call of `uid` waiting for a publish, until the charge is destroyed.
  // RESOURCE_EXHAUSTED naming the uid, its waiting calls, the limit and --uid-waiters if the uid
  // has as many waiting as allowed.
  absl::StatusOr<WaitCharge> StartWait(uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);

  // Counts `count` slots of `uid`'s lease pages as leases, with its RPC leases against
  // --uid-leases (see LeaseBoard): RESOURCE_EXHAUSTED as SessionCharge::AddLeases, nothing
  // counted then. DropPageLeases gives them back. REQUIRES (Drop): `uid` holds that many.
  absl::Status AddPageLeases(uint32_t uid, uint64_t count) ABSL_LOCKS_EXCLUDED(mu_) {
    return Add(uid, Kind::kLease, count);
  }
  void DropPageLeases(uint32_t uid, uint64_t count) ABSL_LOCKS_EXCLUDED(mu_) {
    Drop(uid, Kind::kLease, count);
  }

  // OK if a reconnecting session may list `entries` leases to take back (one per entry of
  // SessionOpen.held_tensor_ids); RESOURCE_EXHAUSTED naming the field and --uid-leases if more
  // than one uid may hold at all.
  absl::Status CheckHeldList(uint64_t entries) const;

  const UidLimitsConfig& config() const { return config_; }
  // What `uid` holds now (all zero for a uid holding nothing).
  UidUsage Usage(uint32_t uid) const ABSL_LOCKS_EXCLUDED(mu_);
  // The uids with an open session that has created host tensors (SessionCharge::MarkCreating).
  std::set<uint32_t> CreatingUids() const ABSL_LOCKS_EXCLUDED(mu_);
  // How many uids hold anything (a uid holding nothing is forgotten).
  size_t uid_count() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class Kind { kSession, kLease, kWaiter, kBytes, kCreating };

  // The field of `usage` counting `kind`, and the limit of `kind` (0: none).
  static uint64_t* Counter(UidUsage& usage, Kind kind);
  uint64_t Limit(Kind kind) const;
  // Adds `amount` of `kind` to `uid` if its limit allows; RESOURCE_EXHAUSTED (see the charge
  // functions) and nothing added otherwise.
  absl::Status Add(uint32_t uid, Kind kind, uint64_t amount) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `amount` of `kind` from `uid`. REQUIRES: it holds at least that much.
  void Drop(uint32_t uid, Kind kind, uint64_t amount) ABSL_LOCKS_EXCLUDED(mu_);

  const UidLimitsConfig config_;
  mutable Mutex mu_;
  std::map<uint32_t, UidUsage> usage_ ABSL_GUARDED_BY(mu_);  // only uids holding something
};

// One session's part of its uid's counts: the session itself, its RPC leases and its unpublished
// bytes. Move-only; destroying it (when the session closes) gives all of them back. A
// default-constructed charge belongs to no UidLimits and allows everything.
class UidLimits::SessionCharge {
 public:
  SessionCharge() = default;
  SessionCharge(SessionCharge&& other) noexcept;
  SessionCharge& operator=(SessionCharge&& other) noexcept;
  ~SessionCharge();

  // Counts `count` more leases of this session. RESOURCE_EXHAUSTED naming the uid, its leases,
  // the limit and --uid-leases if that would pass the limit; nothing counted then.
  absl::Status AddLeases(uint64_t count = 1);
  // REQUIRES: count <= leases().
  void DropLeases(uint64_t count = 1);
  // Counts `bytes` more of unpublished buffers. RESOURCE_EXHAUSTED naming the uid, its bytes,
  // the request, the limit and --uid-quota if that would pass the limit; nothing counted then.
  absl::Status AddUnpublished(uint64_t bytes);
  // REQUIRES: bytes <= unpublished_bytes().
  void DropUnpublished(uint64_t bytes);
  // Counts this session among its uid's sessions that create host tensors (once; until the
  // charge is destroyed): the uid then shares the host pool with the others that do.
  void MarkCreating();

  uint64_t leases() const { return leases_; }
  uint64_t unpublished_bytes() const { return bytes_; }

 private:
  friend class UidLimits;
  SessionCharge(UidLimits* limits, uint32_t uid) : limits_(limits), uid_(uid) {}
  void Release();

  UidLimits* limits_ = nullptr;
  uint32_t uid_ = 0;
  uint64_t leases_ = 0;
  uint64_t bytes_ = 0;
  bool creating_ = false;
};

// One waiting Acquire call. Move-only; destroying it ends the wait's count.
class UidLimits::WaitCharge {
 public:
  WaitCharge() = default;
  WaitCharge(WaitCharge&& other) noexcept;
  WaitCharge& operator=(WaitCharge&& other) noexcept;
  ~WaitCharge();

 private:
  friend class UidLimits;
  WaitCharge(UidLimits* limits, uint32_t uid) : limits_(limits), uid_(uid) {}
  void Release();

  UidLimits* limits_ = nullptr;
  uint32_t uid_ = 0;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_UID_LIMITS_H_
